"""The drive-endurance budget (gdswriter/endurance.py): recorded health logs of real data-center
drives (sources named in tests/data/nvme/), the raw log page, the budget arithmetic, the
checkpointer's one-time warning over real saves (the budget given through the public knobs:
drive_tbw / GDSWRITER_DRIVE_TBW), and doctor's report on this machine's drive.

What ran where: everything here runs on this machine, whose disk (virtio) has no NVMe health
log; the NVMe paths are fed the recorded logs. Reading a real drive's log (nvme-cli, the admin
ioctl) needs an NVMe drive and root, and did not run here."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.ranks import run_ranks

from gdswriter import GDSCheckpointer
from gdswriter.cli import main
from gdswriter.endurance import (DATA_UNIT, Cadence, Drive, Rating, admin_get_log_page, cadence,
                                 drives_of, health_of, parse_log_page, parse_smart_log_json, rating_for, read_health,
                                 remaining_bytes, wear_message)
from gdswriter.errors import HealthLogError, InvalidOptionError
from gdswriter.options import CheckpointOptions
from gdswriter.tools.doctor import endurance_finding

DATA = Path(__file__).parent / "data" / "nvme"
TB = 10**12


def p3700() -> dict:
    return json.loads((DATA / "intel_dc_p3700_400g.smart-log.json").read_text())


def p3600() -> dict[str, str]:
    """The recorded smartctl lines of the DC P3600, as {field: value}."""
    lines = (DATA / "intel_dc_p3600_400g.smartctl.txt").read_text().splitlines()
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln and not ln.startswith("#"))}


def number(text: str) -> int:
    return int(text.split()[0].rstrip("%").replace(",", ""), 0)


def log_page(*, warning=0, spare=0, used=0, read=0, written=0, hours=0) -> bytes:
    """A 512-byte log page 02h laid out as the NVMe base specification says (constructed here from
    recorded values: byte 0 critical warning, 3 available spare, 5 percentage used, 32 data
    units read, 48 data units written, 128 power-on hours; 128-bit little-endian counters)."""
    raw = bytearray(512)
    raw[0], raw[3], raw[5] = warning, spare, used
    raw[32:48] = read.to_bytes(16, "little")
    raw[48:64] = written.to_bytes(16, "little")
    raw[128:144] = hours.to_bytes(16, "little")
    return bytes(raw)


def test_a_recorded_nvme_cli_smart_log_of_a_data_center_drive_parses():
    rec = p3700()
    h = parse_smart_log_json(json.dumps(rec["smart_log"]))
    assert (h.percentage_used, h.data_units_written, h.data_units_read) == (3, 464403132, 228744653)
    assert (h.critical_warning, h.available_spare, h.power_on_hours) == (0, 100, 27567)
    assert h.bytes_written == 464403132 * 512_000 == 237_774_403_584_000  # 237.8 TB
    assert parse_smart_log_json(rec) == h  # the object holding it under "smart_log" too
    # nvme-cli 2.x's other shapes of the same log (constructed: counters as strings, the
    # critical warning spelled out with its byte as "value")
    v2 = dict(rec["smart_log"], data_units_written="464403132", critical_warning={"value": 0, "ro": 0})
    assert parse_smart_log_json(v2) == h
    for bad in ("Smart Log for NVME device:nvme0", json.dumps({"temperature": 311}),
                json.dumps(dict(rec["smart_log"], percent_used=None))):
        with pytest.raises(HealthLogError):
            parse_smart_log_json(bad)


def test_the_raw_log_page_gives_what_nvme_cli_gives():
    s = p3700()["smart_log"]
    raw = log_page(warning=s["critical_warning"], spare=s["avail_spare"], used=s["percent_used"],
                   read=s["data_units_read"], written=s["data_units_written"], hours=s["power_on_hours"])
    assert parse_log_page(raw) == parse_smart_log_json(s)
    big = log_page(written=(1 << 100) + 5)  # the counters are 128-bit
    assert parse_log_page(big).data_units_written == (1 << 100) + 5
    with pytest.raises(HealthLogError, match="512 bytes"):
        parse_log_page(raw[:511])


def test_the_budget_of_a_worn_data_center_drive():
    """The DC P3600 (3 drive writes/day, 5 years): 12% used after 349 TB written. Its rating is
    400.09 GB x 3 x 365 x 5 = 2190.5 TB; what is left is the lesser of 2190.5 - 349.5 TB (by
    bytes written) and 88% of 2190.5 TB (by the drive's own wear)."""
    f = p3600()
    h = parse_log_page(log_page(warning=number(f["Critical Warning"]), spare=number(f["Available Spare"]),
                                used=number(f["Percentage Used"]), read=number(f["Data Units Read"]),
                                written=number(f["Data Units Written"])))
    assert (h.percentage_used, h.bytes_written) == (12, 682594316 * DATA_UNIT)
    capacity = number(f["Namespace 1 Size/Capacity"])
    r = rating_for(f["Model Number"], capacity, None)
    assert r is not None and "DC P3600" in r.source and r.total_bytes == capacity * 3 * 365 * 5
    left = remaining_bytes(h, r)
    assert left == r.total_bytes - h.bytes_written  # 1841 TB: below 88% of the rating (1927.6 TB)
    assert 1840 * TB < left < 1842 * TB
    # worn faster than written: the wear decides
    assert remaining_bytes(replace(h, percentage_used=50), r) == r.total_bytes // 2
    # past its life (percentage used may pass 100): nothing left, never negative
    assert remaining_bytes(replace(h, percentage_used=130), r) == 0
    # no health log: counted as new; no rating: no budget
    assert remaining_bytes(None, r) == r.total_bytes and remaining_bytes(h, None) is None
    # the user's rating wins over the table; an unknown model has none
    assert rating_for(f["Model Number"], capacity, 1000.0) == Rating(1000 * TB, "GDSWRITER_DRIVE_TBW / "
                                                                                 "drive_tbw=1000 TB")
    assert rating_for("QEMU NVMe Ctrl", capacity, None) is None


def test_the_recorded_p3700_against_a_schedule_and_in_doctor():
    rec = p3700()
    h = parse_smart_log_json(rec)
    d = Drive("nvme2n1", "nvme2", rec["model"], rec["capacity_bytes"])
    r = rating_for(d.model, d.capacity_bytes, None)
    assert r is not None and r.total_bytes == rec["capacity_bytes"] * 10 * 365 * 5  # 7.30 PB
    left = remaining_bytes(h, r)
    assert left == r.total_bytes - h.bytes_written  # 7.06 PB
    # 100 GB every 10 minutes: 14.4 TB/day: 491 days of the 7.06 PB
    pace = Cadence(600.0, 100e9, 10)
    msg = wear_message("/nvme/ckpt", d, h, "recorded", r, pace, 1095)
    assert msg is not None
    for part in ("a save every 600 s", "100.00 GB each", "nvme2n1 (INTEL SSDPEDMD400G4)", "14.40 TB/day",
                 "7.06 PB of 7.30 PB rated", "3% used", "lasts 491 days", "horizon of 1095 days"):
        assert part in msg, (part, msg)
    assert wear_message("/nvme/ckpt", d, h, "recorded", r, pace, 400) is None
    # a stripe member takes its share: half the bytes, twice the days
    half = Drive("nvme2n1", "nvme2", rec["model"], rec["capacity_bytes"], share=0.5)
    assert "lasts 981 days" in wear_message("/nvme/ckpt", half, h, "recorded", r, pace, 1095)
    ok = endurance_finding("target /nvme/ckpt", d, h, "nvme smart-log /dev/nvme2", r)
    assert ok.status == "OK" and "3% used, 237.77 TB written; 7.06 PB of 7.30 PB rated endurance left" in ok.summary
    worn = endurance_finding("target /nvme/ckpt", d, replace(h, percentage_used=95), "recorded", r)
    assert worn.status == "WARN" and "replacement" in worn.fix
    unreadable = endurance_finding("target /nvme/ckpt", d, None, "admin ioctl on /dev/nvme2: Permission denied", r)
    assert unreadable.status == "WARN" and "root" in unreadable.fix


def _fake_nvme_cli(bin_dir: Path, script: str) -> None:
    bin_dir.mkdir()
    exe = bin_dir / "nvme"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(0o755)


def test_the_health_log_is_read_through_nvme_cli_when_it_is_installed(tmp_path, monkeypatch):
    """A stand-in `nvme` on PATH (the public seam: the program nvme-cli installs) prints the
    recorded DC P3700 log for `nvme smart-log /dev/nvme7 -o json`, and fails otherwise."""
    log = tmp_path / "smart.json"
    log.write_text(json.dumps(p3700()["smart_log"]))
    _fake_nvme_cli(tmp_path / "bin", f'[ "$*" = "smart-log /dev/nvme7 -o json" ] && exec cat {log}\n'
                                     f'echo "unexpected arguments: $*" >&2; exit 1\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    health, how = read_health(Drive("nvme7n1", "nvme7", "INTEL SSDPEDMD400G4", 400088457216))
    assert how == "nvme smart-log /dev/nvme7" and health == parse_smart_log_json(p3700())
    # nvme-cli refusing (not root): the admin ioctl is tried next, and both reasons are given
    health, how = read_health(Drive("nvme8n1", "nvme8", None, None))
    assert health is None and "nvme smart-log: unexpected arguments: smart-log /dev/nvme8 -o json" in how
    assert "admin ioctl on /dev/nvme8" in how


def test_the_admin_ioctl_is_refused_by_what_is_no_nvme_controller(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvme-cli
    with pytest.raises(OSError):
        admin_get_log_page("/dev/null")  # a real ioctl, refused (ENOTTY) by a device that is no NVMe controller
    health, how = read_health(Drive("nvme42n1", "nvme42", None, None))
    assert health is None and how.startswith("nvme-cli is not installed; admin ioctl on /dev/nvme42: ")


def test_the_cadence_is_measured_from_the_saves():
    assert cadence([0.0, 10.0], [5, 5]) is None  # two saves: too early to say
    c = cadence([0.0, 10.0, 20.0, 90.0, 100.0], [4, 4, 4, 4, 4])
    assert c is not None and c.interval_s == 10.0 and c.bytes_per_save == 4 and c.saves == 5  # the median gap
    assert c.bytes_per_day == 4 * 86400 / 10


def _saves(tmp_path: Path, n: int, options: CheckpointOptions | None = None) -> None:
    state = {"w": torch.randn(1 << 20)}  # 4 MiB: above every small-copy threshold
    with GDSCheckpointer(state, None, tmp_path / "ckpt", options=options) as ck:
        for step in range(n):
            ck.save(step)
            state["w"].add_(1)
            time.sleep(0.01)


def _wear_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "checkpoint schedule" in r.getMessage()]


def test_real_saves_against_a_small_rated_budget_warn_once_with_the_numbers(tmp_path, caplog, io_fresh_log_once):
    opts = CheckpointOptions(drive_tbw=0.001, endurance_horizon_days=365)  # a 1 GB drive: worn out within a day
    with caplog.at_level(logging.WARNING, logger="gdswriter"):
        _saves(tmp_path, 2, opts)
        assert _wear_warnings(caplog) == []  # two saves: no cadence yet
        _saves(tmp_path / "b", 6, opts)
    said = _wear_warnings(caplog)
    drives = drives_of(tmp_path)
    assert len(said) == len(drives) >= 1, said
    msg = said[0]
    assert "measured over 3 saves" in msg and "4.19 MB each" in msg and "1.00 GB rated" in msg
    assert "drive_tbw=0.001 TB" in msg and "horizon of 365 days" in msg
    if drives[0].controller is None:
        assert "wear unknown, counted as new" in msg and "not an NVMe drive" in msg


def test_the_environment_knobs_set_the_budget_and_turn_the_check_off(tmp_path, caplog, monkeypatch, io_fresh_log_once):
    monkeypatch.setenv("GDSWRITER_DRIVE_TBW", "0.001")
    monkeypatch.setenv("GDSWRITER_ENDURANCE_HORIZON_DAYS", "off")
    with caplog.at_level(logging.WARNING, logger="gdswriter"):
        _saves(tmp_path / "off", 4)
        assert _wear_warnings(caplog) == []
        monkeypatch.setenv("GDSWRITER_ENDURANCE_HORIZON_DAYS", "30")
        _saves(tmp_path / "on", 4)
        assert len(_wear_warnings(caplog)) >= 1 and "horizon of 30 days" in _wear_warnings(caplog)[0]


def test_a_schedule_within_the_budget_says_nothing(tmp_path, caplog, monkeypatch, io_fresh_log_once):
    monkeypatch.setenv("GDSWRITER_DRIVE_TBW", "1e9")  # a rating no schedule here wears out in 3 years
    with caplog.at_level(logging.WARNING, logger="gdswriter"):
        _saves(tmp_path, 5)
    assert _wear_warnings(caplog) == []


def _rank_saves(rank: int, world: int, roots: list[str]) -> dict:
    """Four saves of a state of 4 MiB per rank (2 MiB replicated, split over the ranks, and 2 MiB
    of its own) against a 1 GB rating; what the rank's log said about the drives."""
    heard: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    logging.getLogger("gdswriter").addHandler(Keep(logging.WARNING))
    state = {"shared": torch.ones(1 << 19), "own": torch.full((1 << 19,), float(rank))}
    opts = CheckpointOptions(drive_tbw=0.001, endurance_horizon_days=365)
    with GDSCheckpointer(state, None, roots[rank], options=opts) as ck:
        for step in range(4):
            ck.save(step)
            time.sleep(0.01)
        steps = ck.steps()
    return {"wear": [m for m in heard if "checkpoint schedule" in m],
            "failed": [m for m in heard if "endurance check failed" in m], "steps": steps}


def test_each_rank_counts_its_own_saves_against_its_drives(tmp_path):
    roots = [str(tmp_path / f"node{r}") for r in range(2)]  # node-local roots
    results = run_ranks(2, _rank_saves, roots, out=tmp_path / "ranks")
    for r, res in enumerate(results):
        assert res["steps"] == [0, 1, 2, 3] and res["failed"] == [], res
        assert len(res["wear"]) == len(drives_of(tmp_path)) >= 1, res
        assert f"under {roots[r]} " in res["wear"][0] and "measured over 3 saves" in res["wear"][0]


def test_the_options_are_validated():
    for bad in (0, -1, float("inf"), True, "365"):
        with pytest.raises(InvalidOptionError, match="endurance_horizon_days"):
            CheckpointOptions(endurance_horizon_days=bad)
        with pytest.raises(InvalidOptionError, match="drive_tbw"):
            CheckpointOptions(drive_tbw=bad)
    assert CheckpointOptions(endurance_horizon_days=None).endurance_horizon_days is None
    assert CheckpointOptions().endurance_horizon_days == 3 * 365


def test_bad_environment_knobs_say_what_to_write(monkeypatch):
    monkeypatch.setenv("GDSWRITER_DRIVE_TBW", "7PB")
    with pytest.raises(InvalidOptionError, match="GDSWRITER_DRIVE_TBW='7PB'.*e.g. 7008"):
        CheckpointOptions()
    monkeypatch.delenv("GDSWRITER_DRIVE_TBW")
    monkeypatch.setenv("GDSWRITER_ENDURANCE_HORIZON_DAYS", "a year")
    with pytest.raises(InvalidOptionError, match="GDSWRITER_ENDURANCE_HORIZON_DAYS"):
        CheckpointOptions()


def test_doctor_on_this_machine_says_whether_the_drive_has_a_health_log(capsys, tmp_path):
    rc = main(["doctor", "--json", "--no-io-test", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    found = [f for f in report["findings"] if f["scope"] == f"target {tmp_path}" and f["check"] == "endurance"]
    drives = drives_of(tmp_path)
    assert rc == 0 and len(found) == len(drives) >= 1
    for f, d in zip(found, drives):
        health, how = health_of(d)
        assert f["data"]["drive"] == d.name and f["data"]["read"] == how
        if d.controller is None:  # this machine: a virtio disk
            assert health is None and f["status"] == "OK"
            assert f["summary"].startswith(f"no NVMe health log ({d.name} is a ") and "not an NVMe drive" in how
            assert "wear and remaining endurance are not visible here" in f["summary"]


def test_a_file_system_without_a_drive_has_no_endurance_finding(capsys):
    shm = Path("/dev/shm")
    if not shm.is_dir() or drives_of(shm):
        pytest.skip("no tmpfs at /dev/shm")
    main(["doctor", "--json", "--no-io-test", str(shm)])
    report = json.loads(capsys.readouterr().out)
    assert not [f for f in report["findings"] if f["check"] == "endurance"]


# ----------------------------------------------------------------------------- what each save wrote
def test_ls_shows_the_bytes_each_step_wrote(capsys, tmp_path):
    _saves(tmp_path, 3, CheckpointOptions(endurance_horizon_days=None))
    root = tmp_path / "ckpt"
    on_disk = {int(d.name.split("_")[1]): sum(f.stat().st_size for f in d.iterdir()) for d in root.glob("step_*")}
    assert main(["ls", "--json", str(root)]) == 0
    steps = json.loads(capsys.readouterr().out)[0]["steps"]
    assert {s["step"]: s["bytes"] for s in steps} == on_disk and min(on_disk.values()) > 4 << 20
    assert main(["ls", str(root)]) == 0
    text = capsys.readouterr().out
    from gdswriter.units import human

    total = sum(on_disk.values())
    assert f"  written: {human(total)} by the 3 steps listed, {human(total / 3)} per step on average" in text


def test_bench_reports_the_bytes_one_save_of_each_method_writes(tmp_path):
    from gdswriter.tools.bench import BenchOptions, run_bench

    res = run_bench(BenchOptions(directory=tmp_path, size=256 * 1024, rounds=1, compare=("torch",), settle=0,
                                 use_fio=False))
    assert set(res.written) == {"gdswriter", "torch"}
    for m, n in res.written.items():
        assert res.bytes <= n < res.bytes + (1 << 20), (m, n)  # the state, plus headers, manifest, padding
        assert res.to_json()["methods"][m]["written_bytes"] == n
    assert any(line.startswith("  bytes one save writes (its files on disk): gdswriter ") for line in res.header())
