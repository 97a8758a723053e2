"""Topology discovery (fake sysfs trees and a fake NVML, plus this real machine), the JSON
form and its fixtures, the `gdswriter topology` command, and plan_for_save."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gdswriter.cli import main
from gdswriter.errors import InvalidOptionError
from gdswriter.planner.affinity import place_roots, plan_for_save
from gdswriter.planner.assign import FileTarget, plan_save
from gdswriter.planner.discover import discover, root_dev
from gdswriter.planner.topology import Distance, Drive, Gpu, Mount, NumaNode, Topology, normalize_bdf

FIXTURES = Path(__file__).parent / "data" / "topologies"
GiB = 1 << 30


def fixture(name: str) -> Topology:
    return Topology.load(FIXTURES / f"{name}.json")


# -- a fake machine -----------------------------------------------------------------------

class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The pynvml calls discovery makes; GPU 1's NUMA node is 'not supported'."""

    NVMLError = FakeNVMLError

    def __init__(self, bus_ids, fail_init=False):
        self.bus_ids, self.fail_init, self.shut = bus_ids, fail_init, False

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.bus_ids)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.bus_ids[h].encode())

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"

    def nvmlDeviceGetNumaNodeId(self, h):
        if h == 1:
            raise FakeNVMLError("Not Supported")
        return 0


def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, link.parent), link)


def fake_machine(tmp: Path, extra_mounts: str = "") -> tuple[Path, Path]:
    """A two-socket machine: socket 0 has GPU 03:00.0 and nvme0 under one switch; socket 1
    has nvme1 on a root port, GPU 82:00.0 on another and nvme2 (multipath head) on a third.
    /raid = md0 raid0 over nvme0n1p1 + nvme1n1; /lvm = LVM over nvme2n1; /data one = nvme1n1."""
    sys_, proc = tmp / "sys", tmp / "proc"
    for node, cpus, sock in ((0, "0-3", 0), (1, "4-7", 1)):
        _w(sys_ / f"devices/system/node/node{node}/cpulist", cpus)
        _w(sys_ / f"devices/system/cpu/cpu{4 * node}/topology/physical_package_id", str(sock))
    dev = sys_ / "devices"
    rp0 = dev / "pci0000:00/0000:00:01.0"
    usp = rp0 / "0000:01:00.0"
    gpu0 = usp / "0000:02:00.0/0000:03:00.0"
    ssd0 = usp / "0000:02:01.0/0000:04:00.0"
    ssd1 = dev / "pci0000:80/0000:80:01.0/0000:81:00.0"
    gpu1 = dev / "pci0000:80/0000:80:02.0/0000:82:00.0"
    ssd2 = dev / "pci0000:80/0000:80:03.0/0000:83:00.0"
    for p, numa in ((rp0, 0), (usp, 0), (gpu0, 0), (ssd0, 0), (ssd1, 1), (gpu1.parent, 1), (gpu1, -1), (ssd2, 1)):
        _w(p / "numa_node", str(numa))
    for pci in (gpu0, gpu1, ssd0, ssd1, ssd2):
        _link(sys_ / "bus/pci/devices" / pci.name, pci)
    blocks = {}
    for name, pci in (("nvme0", ssd0), ("nvme1", ssd1), ("nvme2", ssd2)):
        ctrl = pci / "nvme" / name
        _w(ctrl / "model", f"Fake {name}   ")
        _w(ctrl / "transport", "pcie")
        _link(ctrl / "device", pci)
        _link(sys_ / "class/nvme" / name, ctrl)
        blocks[name] = ctrl
    ns0 = blocks["nvme0"] / "nvme0n1"
    part = ns0 / "nvme0n1p1"
    _w(part / "partition", "1")
    ns1 = blocks["nvme1"] / "nvme1n1"
    (ns1 / "slaves").mkdir(parents=True)
    subsys = dev / "virtual/nvme-subsystem/nvme-subsys2"
    ns2 = subsys / "nvme2n1"
    ns2.mkdir(parents=True)
    _link(subsys / "nvme2", blocks["nvme2"])
    md = dev / "virtual/block/md0"
    _w(md / "md/level", "raid0")
    _link(md / "slaves/nvme0n1p1", part)
    _link(md / "slaves/nvme1n1", ns1)
    dm = dev / "virtual/block/dm-0"
    _w(dm / "dm/uuid", "LVM-Xyz")
    _w(dm / "dm/name", "vg-lv")
    _link(dm / "slaves/nvme2n1", ns2)
    zram = dev / "virtual/block/zram0"
    zram.mkdir(parents=True)
    for majmin, target in (("259:1", part), ("259:2", ns1), ("9:0", md), ("253:0", dm), ("252:0", zram)):
        _link(sys_ / "dev/block" / majmin, target)
    _w(proc / "self/mountinfo", "\n".join([
        "22 1 0:21 / /proc rw,relatime - proc proc rw",
        "30 1 9:0 / /raid rw,relatime - ext4 /dev/md0 rw",
        "31 1 253:0 / /lvm rw,relatime - xfs /dev/mapper/vg-lv rw",
        "32 1 259:2 / /data\\040one rw,relatime - ext4 /dev/nvme1n1 rw",
        "33 1 0:40 / /dev/shm rw - tmpfs tmpfs rw",
        "34 1 0:41 / /net rw - nfs4 server:/export rw",
        "35 1 252:0 / /swapfs rw - ext4 /dev/zram0 rw",
    ] + ([extra_mounts] if extra_mounts else [])))
    return sys_, proc


@pytest.fixture
def machine(tmp_path):
    return fake_machine(tmp_path)


def test_discovery_of_a_fake_two_socket_machine(machine):
    sys_, proc = machine
    nvml = FakeNVML(["00000000:03:00.0", "0000:82:00.0"])
    t = discover(sysfs=sys_, proc=proc, nvml=nvml)
    assert nvml.shut
    assert [(n.node, n.socket, n.cpus) for n in t.numa] == [(0, 0, "0-3"), (1, 1, "4-7")]
    g0, g1 = t.gpus
    assert (g0.index, g0.pci, g0.name, g0.numa) == (0, "0000:03:00.0", "Fake GPU", 0)
    assert g0.path == ("0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0")
    # NVML cannot say GPU 1's node, its own numa_node says -1: its root port's node counts
    assert (g1.pci, g1.numa, g1.path) == ("0000:82:00.0", 1, ("0000:80:02.0", "0000:82:00.0"))
    drives = {d.name: d for d in t.drives}
    assert set(drives) == {"nvme0", "nvme1", "nvme2"}
    assert drives["nvme0"] == Drive("nvme0", "nvme", "0000:04:00.0", 0,
                                    ("0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"), "Fake nvme0")
    mounts = {m.mountpoint: m for m in t.mounts}
    assert set(mounts) == {"/raid", "/lvm", "/data one"}, "pseudo, memory, network and zram mounts left out"
    raid = mounts["/raid"]
    assert (raid.kind, raid.drives, raid.dev, raid.source) == ("raid0", ("nvme0", "nvme1"), "9:0", "/dev/md0")
    assert raid.layout == "md0 raid0 over nvme0n1p1 on nvme0n1, nvme1n1"
    assert (mounts["/lvm"].kind, mounts["/lvm"].drives) == ("dm", ("nvme2",))
    assert mounts["/lvm"].layout == "vg-lv (lvm) over nvme2n1"
    assert (mounts["/data one"].kind, mounts["/data one"].drives) == ("disk", ("nvme1",))
    # distances: same switch, same socket, across sockets
    assert t.distance(g0, drives["nvme0"]) == Distance.SWITCH
    assert t.distance(g0, drives["nvme1"]) == Distance.REMOTE
    assert t.distance(g1, drives["nvme1"]) == Distance.NUMA
    assert t.switch_of(g0) == "0000:00:01.0" and t.switch_of(g1) is None
    assert t.affinity_problems() == []
    assert not any("no affinity" in n for n in t.notes)
    assert Topology.from_json(t.to_json()) == t


def test_discovery_degrades_without_nvml_nvme_or_numa(tmp_path, monkeypatch):
    # an empty sysfs and proc: nothing to find, nothing fails
    t = discover(sysfs=tmp_path / "sys", proc=tmp_path / "proc", nvml=FakeNVML([], fail_init=True))
    assert t.gpus == t.drives == t.mounts == t.numa == ()
    text = " ".join(t.notes)
    assert "cannot initialise (Driver Not Loaded)" in text
    assert "no NVMe controllers" in text and "mountinfo" in text
    assert "no affinity: no GPUs found; no drives with a known location" in text
    # nvidia-ml-py missing altogether
    monkeypatch.setitem(sys.modules, "pynvml", None)
    t = discover(sysfs=tmp_path / "sys", proc=tmp_path / "proc")
    assert any("nvidia-ml-py is not installed" in n for n in t.notes)


def test_a_root_on_tmpfs_or_a_single_node_machine(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    st = os.stat(root)
    line = f"40 1 {os.major(st.st_dev)}:{os.minor(st.st_dev)} / {tmp_path} rw - tmpfs tmpfs rw"
    sys_, proc = fake_machine(tmp_path / "m", extra_mounts=line)
    t = discover(sysfs=sys_, proc=proc, nvml=FakeNVML([]), roots=[root / "not-yet" / "made"])
    m = t.mount_of(root, root_dev(root))
    assert (m.mountpoint, m.kind, m.drives) == (str(tmp_path), "memory", ())
    targets = place_roots(t, [root], [root_dev(root)])
    assert targets[0].drives == () and targets[0].weight == 1
    # one NUMA node: devices reporting -1 are on it
    single = tmp_path / "single"
    _w(single / "sys/devices/system/node/node0/cpulist", "0-1")
    gpu = single / "sys/devices/pci0000:00/0000:00:05.0"
    _w(gpu / "numa_node", "-1")
    _link(single / "sys/bus/pci/devices/0000:00:05.0", gpu)
    t = discover(sysfs=single / "sys", proc=single / "proc", nvml=FakeNVML(["0000:00:05.0"]))
    assert t.gpus[0].numa == 0 and t.gpus[0].path == ("0000:00:05.0",)
    assert any("one NUMA node" in n for n in t.notes)


def test_discovery_on_this_machine_never_fails():
    here = Path.cwd()
    t = discover(roots=[here])
    assert t.live and t.numa, "every Linux machine has at least node 0"
    m = t.mount_of(here, root_dev(here))
    assert m is not None, f"no mount found for {here} in {[x.mountpoint for x in t.mounts]}"
    if not t.gpus:
        assert any(n.startswith("no affinity") for n in t.notes)
    assert Topology.from_json(t.to_json()) == t


# -- the value and its JSON -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["dgx_a100", "dgx_h100", "two_socket_4gpu"])
def test_fixtures_round_trip_and_describe_their_sources(name):
    t = fixture(name)
    assert Topology.from_json(t.to_json()) == t
    assert t.notes and t.gpus and t.drives and len(t.sockets) == 2
    assert t.affinity_problems() == []


def test_fixture_distances_match_the_published_affinity():
    a = fixture("dgx_a100")
    d = {x.name: x for x in a.drives}
    pairs = {0: ("nvme0", "nvme1"), 1: ("nvme0", "nvme1"), 2: ("nvme4", "nvme5"), 3: ("nvme4", "nvme5"),
             4: ("nvme6", "nvme7"), 5: ("nvme6", "nvme7"), 6: ("nvme8", "nvme9"), 7: ("nvme8", "nvme9")}
    for g in a.gpus:
        near = {name for name in d if a.distance(g, d[name]) == Distance.SWITCH}
        assert near == set(pairs[g.index]), g
    assert a.distance(a.gpu(0), d["nvme4"]) == Distance.SOCKET  # NUMA 3 and 1, both socket 0 (NPS4)
    assert a.distance(a.gpu(0), d["nvme6"]) == Distance.REMOTE
    assert a.distance(a.gpu(0), d["nvme2"]) == Distance.SOCKET
    h = fixture("dgx_h100")
    hd = {x.name: x for x in h.drives}
    assert h.distance(h.gpu(0), hd["nvme0"]) == Distance.NUMA
    assert h.distance(h.gpu(0), hd["nvme4"]) == Distance.REMOTE
    assert h.distance(h.gpu(7), hd["nvme7"]) == Distance.NUMA
    raid = h.mount_of("/raid/ckpt/step-1")
    assert raid.mountpoint == "/raid" and raid.kind == "raid0" and raid.width == 8
    assert h.mount_of("/home/me").mountpoint == "/" and h.mount_of("/home/me").width == 1  # RAID-1


def test_unknown_distances():
    t = Topology(numa=(NumaNode(0, 0), NumaNode(1, -1)))
    a = Gpu(0, "0000:01:00.0", numa=0, path=("0000:00:01.0", "0000:01:00.0"))
    assert t.distance(a, Drive("x")) == Distance.UNKNOWN
    assert t.distance(a, Drive("y", numa=1)) == Distance.UNKNOWN, "node 1's socket is not known"
    # no node reported, same host bridge: same root complex
    b = Drive("z", pci="0000:00:02.0", path=("0000:00:02.0",))
    assert t.distance(Gpu(1, "0000:00:05.0", path=("0000:00:05.0",)), b) == Distance.NUMA


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema="other"), "not a gdswriter topology"),
    (lambda d: d.update(version=2), "version 2 is not supported"),
    (lambda d: d["gpus"].append(dict(d["gpus"][0])), "GPU index [0] listed twice"),
    (lambda d: d["gpus"][0].update(pci="0000:99:00.0"), "must end at the device itself"),
    (lambda d: d["mounts"][0]["drives"].append("nvme42"), "names drives ['nvme42']"),
    (lambda d: d["gpus"][0].update(pci="zz"), "is not a PCI address"),
    (lambda d: d["gpus"][0].pop("index"), "malformed topology (KeyError"),
])
def test_bad_topology_files_get_clear_errors(mutate, message):
    data = json.loads((FIXTURES / "dgx_h100.json").read_text())
    mutate(data)
    with pytest.raises(InvalidOptionError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Topology.from_dict(data, where="x.json")
    with pytest.raises(InvalidOptionError, match="not JSON"):
        Topology.from_json("{", where="x.json")


def test_normalize_bdf():
    assert normalize_bdf("00000000:1B:00.0") == "0000:1b:00.0"
    assert normalize_bdf(b"0000:07:00.1") == "0000:07:00.1"


# -- the command --------------------------------------------------------------------------

def test_cli_on_this_machine(capsys, tmp_path):
    assert main(["topology", "."]) == 0
    text = capsys.readouterr().out
    assert "Roots:" in text and "Plan for 8.00 GiB" in text
    assert main(["topology", "--json", ".", "--size", "1M"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["size"] == 1 << 20
    assert sum(f["bytes"] for f in report["plan"]["files"]) == 1 << 20
    assert report["roots"][0]["path"] == "."
    # what --json prints replays
    replay = tmp_path / "topology-live.json"
    replay.write_text(json.dumps(report))
    assert main(["topology", "--replay", str(replay), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["topology"] == report["topology"]


def test_cli_replays_a_dgx(capsys):
    assert main(["topology", "--replay", str(FIXTURES / "dgx_a100.json"), "/raid/ckpt", "--size", "80G"]) == 0
    text = capsys.readouterr().out
    assert "md1 raid0 over nvme0n1" in text and "cannot be chosen" in text
    assert text.count("10.00 GiB") == 8, "each GPU writes its own 10 GiB to the array"
    assert main(["topology", "--json", "--replay", str(FIXTURES / "two_socket_4gpu.json"),
                 "/data0", "/data1", "/data2", "--size", "40G"]) == 0
    report = json.loads(capsys.readouterr().out)
    per_root = [sum(f["bytes"] for f in report["plan"]["files"] if f["root"] == r) for r in range(3)]
    mean = sum(per_root) / 3
    assert all(abs(b - mean) <= 0.05 * mean + 4096 for b in per_root)
    assert per_root[2] > mean, "the lone drive on socket 1 takes its 5% to spare cross-socket bytes"
    assert report["distances"]["gpu0"] == ["numa", "numa", "remote"]


def test_cli_errors(capsys, tmp_path):
    assert main(["topology", "--replay", str(tmp_path / "missing.json")]) == 2
    assert "cannot read topology file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"schema": "gdswriter.topology", "version": 9}')
    assert main(["topology", "--replay", str(tmp_path / "bad.json")]) == 2
    assert "version 9 is not supported" in capsys.readouterr().err
    assert main(["topology", "--size", "lots", "."]) == 2


def test_cli_runs_as_a_module(tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "gdswriter.cli", "topology", "--json", str(tmp_path)], check=False,
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["roots"][0]["path"] == str(tmp_path)


# -- the writer's entry point ---------------------------------------------------------------

def test_plan_for_save_is_gpu_local_on_a_replayed_dgx():
    a = fixture("dgx_a100")
    data = a.mount_of("/raid").drives
    t = a.one_mount_per_drive(data)
    roots = [f"/mnt/{d}" for d in data]
    sizes, devices = [], []
    for g in range(8):  # each GPU: one big and two small storages, sizes not multiples of 4 KiB
        sizes += [GiB + 12345 * g, 4097, 0]
        devices += [f"cuda:{g}"] * 3
    targets = [FileTarget(r, f"data-r{r}-f0.bin") for r in range(len(roots))]
    plan = plan_for_save(sizes, devices, roots, targets, t, cuda_gpus={g: g for g in range(8)})
    assert sorted(f.gpu for f in plan.files) == list(range(8)), "one file per GPU"
    for f in plan.files:
        root = place_roots(t, roots)[f.target.root]
        assert t.distance(t.gpu(f.gpu), t.drive(root.drives[0])) == Distance.SWITCH
        assert f.writer == f"cuda:{f.gpu}" and f.target.name == f"data-r{f.target.root}-gpu{f.gpu}.bin"
        assert {devices[c.storage] for c in f.chunks} == {f.writer}
    assert sorted(c.storage for f in plan.files for c in f.chunks) == list(range(len(sizes)))
    # a CUDA ordinal the topology does not know: planned, but with no preferred root
    plan = plan_for_save([GiB], ["cuda:3"], roots, targets, t, cuda_gpus={})
    assert plan.files[0].gpu is None and any("cuda:3 not found" in n for n in plan.notes)


def test_plan_for_save_in_host_memory_is_todays_plan():
    targets = [FileTarget(r, f"data-r{r}-f{k}.bin") for r in range(2) for k in range(2)]
    sizes = [10 * 4096 + 3, 0, 77]
    plan = plan_for_save(sizes, ["cpu"] * 3, ["/a", "/b"], targets, Topology())
    assert plan.files == plan_save(sizes, targets).files
    with pytest.raises(InvalidOptionError):
        plan_for_save([1, 2], ["cpu"], ["/a"], targets, Topology())


def test_plan_for_save_discovers_the_live_machine(tmp_path):
    plan = plan_for_save([5 * 4096], ["cuda:0"], [tmp_path], [FileTarget(0, "x")], cuda_gpus={})
    assert [f.target.root for f in plan.files] == [0] and plan.files[0].writer == "cuda:0"
    assert sum(c.length for c in plan.files[0].chunks) == 5 * 4096


def test_one_mount_per_drive_replaces_the_array():
    h = fixture("dgx_h100")
    t = h.one_mount_per_drive(["nvme0", "nvme1"])
    points = {m.mountpoint: m for m in t.mounts}
    assert "/raid" not in points and points["/mnt/nvme1"].drives == ("nvme1",)
    assert "/" in points and t.notes[-1].startswith("what-if")
    assert isinstance(t.mount_of("/mnt/nvme0/x"), Mount)


# -- a real GPU (scripts/gpu_check.sh machines) ------------------------------------------------

@pytest.mark.gpu
def test_live_gpu_discovery_and_plan(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    from gdswriter.planner.discover import cuda_gpu_indices

    t = discover(roots=[tmp_path])
    assert len(t.gpus) >= torch.cuda.device_count(), t.notes
    for g in t.gpus:
        assert g.path and g.path[-1] == g.pci, f"GPU {g.index} not found in sysfs: {t.notes}"
    ordinals = cuda_gpu_indices(t)
    assert sorted(ordinals) == list(range(torch.cuda.device_count())), "every CUDA device matched by PCI address"
    x = torch.ones(5 * 4096 + 1, dtype=torch.uint8, device="cuda")
    plan = plan_for_save([x.numel()], [str(x.device)], [tmp_path], [FileTarget(0, "x")], t)
    assert plan.files[0].gpu == ordinals[x.device.index or 0] and plan.files[0].writer == str(x.device)
    assert main(["topology", "--json", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["topology"]["gpus"] and report["plan"]["files"][0]["gpu"] is not None
