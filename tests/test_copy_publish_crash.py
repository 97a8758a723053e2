"""A copy published over an older complete copy of the same rank's files (replicastream.Incoming
.publish: a second refill of a step, as two readers loading it at once do one after the other
under refill.publish_copy's lock, or a damaged copy refilled) is swapped in: a process killed at
any point of the publish leaves ``copies/rank<R>`` whole, the old copy or the new one, never
missing nor half removed while the step's ``protected`` still counts it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WORKER = textwrap.dedent("""
    import json, mmap, os, shutil, signal, sys
    from pathlib import Path
    from gdswriter.distributed import replicastream
    from gdswriter.distributed.replicastream import Incoming, padded
    import crc32c

    copies, where = Path(sys.argv[1]), sys.argv[2]
    new = bytes(range(256)) * 40  # 10240 bytes
    inc = Incoming(copies, 1, json.dumps([["data", "a.bin", len(new)]]).encode())
    block = mmap.mmap(-1, padded(len(new)))  # page-aligned: the copy is written with O_DIRECT
    block[:len(new)] = new
    inc.write(memoryview(block))
    real_rmtree, real_rename = shutil.rmtree, os.rename

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def rmtree_then_killed(*args, **kwargs):
        real_rmtree(*args, **kwargs)
        killed()

    def rename_then_killed(*args, **kwargs):
        real_rename(*args, **kwargs)
        killed()

    if where == "after-rmtree":
        shutil.rmtree = rmtree_then_killed
    elif where == "after-rename":
        os.rename = rename_then_killed
    inc.publish({"ok": True, "crcs": [crc32c.crc32c(new)]})
    print("published")
""")


@pytest.mark.parametrize("where", ["after-rmtree", "after-rename", "none"])
def test_a_copy_published_over_an_older_one_is_whole_after_a_kill(tmp_path: Path, where: str):
    copies = tmp_path / "step_000000000001" / "copies"
    final = copies / "rank00001"
    final.mkdir(parents=True)
    old = b"old copy " * 1000
    (final / "a.bin").write_bytes(old)
    (final / "b.bin").write_bytes(b"the old copy's second file")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", WORKER, str(copies), where], env=env, capture_output=True,
                         text=True, timeout=120)
    new = bytes(range(256)) * 40
    if where == "none":
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode in (0, -signal.SIGKILL), run.stderr
    assert final.is_dir(), (where, sorted(os.listdir(copies)))
    names = sorted(os.listdir(final))
    got = {n: (final / n).read_bytes() for n in names}
    assert got in ({"a.bin": old, "b.bin": b"the old copy's second file"}, {"a.bin": new}), (where, names)
    if run.returncode == 0:
        assert got == {"a.bin": new}
        assert not [n for n in os.listdir(copies) if n.startswith((".tmp-", ".trash-"))]
