"""Progress of long commands (gdswriter/progress.py): drawn on a real terminal (a pty), absent
when stderr is a pipe, and counting reads without changing what the engine returns."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest
import torch

from gdswriter import GDSCheckpointer, ReadSpan, WriteSpan, create_engine
from gdswriter import progress as progress_mod
from gdswriter.progress import Progress

REPO = Path(__file__).resolve().parent.parent


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_text_and_quiet_streams(monkeypatch):
    monkeypatch.delenv("TERM", raising=False)
    tty = _Tty()
    with Progress("export", total=4 << 20, stream=tty, interval=0) as bar:
        bar.advance(1 << 20, note="reading")
        assert "export  [######..................]  25%  1.00 MiB / 4.00 MiB" in bar.line()
        assert "ETA" in bar.line() and bar.line().endswith("reading")
    text = tty.getvalue()
    assert text.startswith("\rexport  [") and text.endswith("\r\x1b[K")  # drawn, then erased
    piped = io.StringIO()  # not a terminal
    with Progress("export", total=10, stream=piped, interval=0) as bar:
        bar.advance(5)
    assert piped.getvalue() == ""
    with Progress("x", total=10, stream=tty, quiet=True, interval=0) as bar:
        assert not bar.enabled
    monkeypatch.setenv("TERM", "dumb")
    assert not Progress("x", stream=_Tty()).enabled
    steps = Progress("bench", total=6, unit="steps", stream=_Tty(), interval=0)
    steps.advance(2, note="round 1/2: torch save")
    assert "2/6 steps" in steps.line() and "round 1/2: torch save" in steps.line()


def test_counted_reads_split_large_spans_and_return_the_engines_checksums(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_mod, "PIECE_BYTES", 64 << 10)
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    path = tmp_path / "f.bin"
    bar = Progress("read", total=data.numel(), stream=_Tty(), interval=0)
    with create_engine() as engine:
        engine.write_file(path, [WriteSpan(0, data)])
        out_a, out_b = torch.empty(300_000, dtype=torch.uint8), torch.empty(1 << 19, dtype=torch.uint8)
        spans = [ReadSpan(0, out_a), ReadSpan(1 << 19, out_b)]
        calls = []
        real = engine.read_file
        monkeypatch.setattr(engine, "read_file", lambda p, s: calls.append(len(s)) or real(p, s))
        crcs = bar.reads(engine).read_file(path, spans)
    assert crcs == [crc32c.crc32c(data[:300_000].numpy()), crc32c.crc32c(data[1 << 19:].numpy())]
    assert torch.equal(out_a, data[:300_000]) and torch.equal(out_b, data[1 << 19:])
    assert len(calls) > 10  # read in batches, so the bar moves
    assert bar.done == 300_000 + (1 << 19)
    assert Progress("x", stream=io.StringIO()).reads(engine) is engine  # nothing wrapped when quiet


def _cli_on_pty(*argv: str) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal: (exit status, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO), TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "gdswriter.cli", *argv], stdout=subprocess.PIPE,
                            stderr=slave, text=True, env=env)
    os.close(slave)
    got = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        got += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(master)
    return proc.returncode, out, got.decode(errors="replace")


@pytest.fixture
def ckpt(tmp_path):
    model = torch.nn.Linear(512, 512)
    with GDSCheckpointer(model, root=tmp_path / "ck") as ck:
        ck.save(1)
        ck.save(2)
    return tmp_path / "ck"


def test_export_and_verify_draw_on_a_terminal_only(ckpt, tmp_path):
    rc, out, term = _cli_on_pty("export", str(ckpt), "--to", "safetensors", str(tmp_path / "a.st"))
    assert rc == 0 and "exported step 2" in out
    assert "export step 2: read  [" in term and "export step 2: write  [" in term and "\x1b[K" in term
    assert "\r" not in out  # stdout never carries the bar
    rc, out, term = _cli_on_pty("verify", str(ckpt), "--all")
    assert rc == 0 and "step 1: OK" in out and "step 2: OK" in out
    assert "verify step 1" in term and "verify step 2" in term
    piped = subprocess.run([sys.executable, "-m", "gdswriter.cli", "export", str(ckpt), "--to", "torch",
                            str(tmp_path / "b.pt")], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert piped.returncode == 0 and piped.stderr == ""
