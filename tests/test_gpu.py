"""GPU memory readers, and whether a runtime fits, on fixture trees in the kernel's formats."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.errors import ApplianceError
from appliance.host import gpu
from appliance.host.gpu import fdinfo, fit, xe
from b70tools import gpu_trees as t
from tests.test_gpu_commands import b70ctl

GIB = t.GIB


# --- the uapi layout, byte for byte ------------------------------------------------------------


def test_ioctl_request_number_matches_the_uapi() -> None:
    # DRM_IOWR(DRM_COMMAND_BASE + DRM_XE_DEVICE_QUERY, struct drm_xe_device_query)
    assert xe.DRM_IOCTL_XE_DEVICE_QUERY == 0xC0286440
    assert xe.DEVICE_QUERY.size == 40
    assert xe.MEM_REGIONS_HEADER.size == 8
    assert xe.MEM_REGION.size == 88


def test_device_query_is_packed_field_by_field() -> None:
    packed = xe.pack_device_query(query=1, size=0x1234, data=0xDEADBEEF)
    expected = (
        (0).to_bytes(8, "little")  # extensions
        + (1).to_bytes(4, "little")  # query: DRM_XE_DEVICE_QUERY_MEM_REGIONS
        + (0x1234).to_bytes(4, "little")  # size
        + (0xDEADBEEF).to_bytes(8, "little")  # data (a user pointer)
        + bytes(16)  # reserved[2]
    )
    assert packed == expected


def test_mem_regions_reply_is_parsed_field_by_field() -> None:
    def region(cls: int, inst: int, total: int, used: int) -> bytes:
        return (
            cls.to_bytes(2, "little")
            + inst.to_bytes(2, "little")
            + (4096).to_bytes(4, "little")
            + total.to_bytes(8, "little")
            + used.to_bytes(8, "little")
            + total.to_bytes(8, "little")
            + used.to_bytes(8, "little")
            + bytes(48)
        )

    reply = (
        (2).to_bytes(4, "little")
        + bytes(4)
        + region(0, 0, 64 * GIB, 0)
        + region(1, 0, 32 * GIB, 5 * GIB)
    )
    regions = xe.parse_mem_regions(reply, used_is_reliable=True)
    assert regions == [xe.Region(0, 0, 64 * GIB, 0), xe.Region(1, 0, 32 * GIB, 5 * GIB)]
    assert xe.parse_mem_regions(reply, used_is_reliable=False)[1].used_bytes is None
    with pytest.raises(ValueError, match="claims 2 regions"):
        xe.parse_mem_regions(reply[:100], used_is_reliable=True)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("4 KiB", 4096),
        ("3 MiB", 3 * 1024**2),
        ("2 GiB", 2 * GIB),
        ("12 TiB", None),
        ("lots", None),
        ("", None),
        ("-5 KiB", None),
    ],
)
def test_sizes_in_fdinfo(text: str, value: int | None) -> None:
    assert fdinfo.parse_size(text) == value


@pytest.mark.parametrize(
    ("cgroup", "unit"),
    [
        ("0::/system.slice/b70-vllm.service\n", "b70-vllm.service"),
        (
            "0::/user.slice/user-0.slice/user@0.service/app.slice/b70-llamacpp.service\n",
            "b70-llamacpp.service",
        ),
        ("0::/system.slice/b70-vllm.service/libpod-payload-5e1f\n", "b70-vllm.service"),
        ("0::/system.slice/docker-5e1f0c.scope\n", "docker-5e1f0c.scope"),
        ("12:memory:/foo\n0::/\n", None),
    ],
)
def test_unit_from_cgroup(cgroup: str, unit: str | None) -> None:
    assert fdinfo.parse_cgroup_unit(cgroup) == unit


# --- fixture trees -----------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return tmp_path / "root"


def test_idle_b70(tree: Path) -> None:
    t.build(tree, [t.Card(t.B70)], [])
    snap = gpu.snapshot(tree)
    (mem,) = snap.devices
    assert mem.device == gpu.Device(t.B70, 0x8086, 0xE223, "xe", "card1", "renderD128")
    assert mem.device.is_b70 and mem.device.name == "Intel Arc Pro B70"
    assert (mem.total_bytes, mem.used_bytes, mem.source) == (32 * GIB, 300 * 1024**2, "xe-query")
    assert mem.holders == []
    assert fit.judge_start(snap, "auto", 24 * GIB, "b70-vllm.service").ok


def test_b70_with_llama_server_holding_22_gib(tree: Path) -> None:
    card = t.Card(t.B70, vram_used=22 * GIB + 300 * 1024**2)
    t.build(tree, [card], [t.llama_server()])
    snap = gpu.snapshot(tree)
    (mem,) = snap.devices
    ((holder, held),) = mem.holders
    assert (holder.pid, holder.unit, held) == (4242, "b70-llamacpp.service", 22 * GIB)
    assert holder.command is not None and holder.command.startswith(
        "/opt/llama.cpp/bin/llama-server --model"
    )
    start = fit.judge_start(snap, "auto", 24 * GIB, "b70-vllm.service")
    assert not start.ok
    assert start.reason == (
        "still held by pid 4242 (/opt/llama.cpp/bin/llama-server --model /srv/b70/models/q.gguf -ngl 99) "
        "in b70-llamacpp.service: 22.0 GiB"
    )
    # The runtime's own memory does not count against itself (a restart of the same unit).
    assert fit.judge_start(snap, "auto", 8 * GIB, "b70-llamacpp.service").ok
    # A switch is fine: the appliance's own memory is released when the runtime stops.
    assert fit.judge_switch(snap, "auto", 26 * GIB, set()).ok


def test_a_foreign_holder_is_named_and_refused(tree: Path) -> None:
    card = t.Card(t.B70, vram_used=20 * GIB + 300 * 1024**2)
    t.build(tree, [card], [t.foreign()])
    snap = gpu.snapshot(tree)
    verdict = fit.judge_switch(snap, "auto", 24 * GIB, set())
    assert not verdict.ok
    assert verdict.reason == (
        "0000:03:00.0: only 11.7 GiB of 32.0 GiB would be free for 24.0 GiB; outside the appliance: "
        "pid 5151 (python3 train.py --epochs 3) in session-3.scope: 20.0 GiB"
    )
    assert fit.judge_switch(snap, "auto", 10 * GIB, set()).ok
    # A container of the appliance lives outside b70 units: its pids are passed in as ours.
    assert fit.judge_switch(snap, "auto", 24 * GIB, {5151}).ok


def test_two_b70s(tree: Path) -> None:
    cards = [t.Card(t.B70), t.Card(t.B70_2, card="card2", render="renderD129", vram_used=GIB)]
    second = t.Proc(
        6000,
        ["llama-server"],
        t.VLLM_CGROUP,
        [t.Client(fd=5, slot=t.B70_2, client_id=3, resident="1 GiB", render="renderD129")],
    )
    t.build(tree, cards, [t.llama_server(), second])
    snap = gpu.snapshot(tree)
    assert [m.device.pci_slot for m in snap.devices] == [t.B70, t.B70_2]
    assert [[h.pid for h, _ in m.holders] for m in snap.devices] == [[4242], [6000]]
    assert [m.device.render_node for m in snap.devices] == ["renderD128", "renderD129"]
    assert fit.pick_device(snap, "auto").device.pci_slot == t.B70  # type: ignore[union-attr]
    assert fit.pick_device(snap, t.B70_2).device.pci_slot == t.B70_2  # type: ignore[union-attr]
    with pytest.raises(ApplianceError, match=r"no Intel GPU at PCI address 0000:04:00\.0"):
        fit.pick_device(snap, "0000:04:00.0")


def test_an_i915_and_an_amdgpu_card_beside_the_b70(tree: Path) -> None:
    cards = [
        t.Card("0000:00:02.0", device=0xA780, driver="i915", card="card0", render="renderD128"),
        t.Card(t.B70, card="card1", render="renderD129"),
        t.Card(
            "0000:0a:00.0",
            vendor=0x1002,
            device=0x744C,
            driver="amdgpu",
            card="card2",
            render="renderD130",
        ),
    ]
    t.build(tree, cards, [])
    snap = gpu.snapshot(tree)
    assert [(m.device.pci_slot, m.device.driver) for m in snap.devices] == [
        ("0000:00:02.0", "i915"),
        (t.B70, "xe"),
    ]
    i915, b70 = snap.devices
    assert (i915.total_bytes, i915.source) == (None, "fdinfo")
    assert b70.total_bytes == 32 * GIB
    assert [d.driver for d in snap.ignored] == ["amdgpu"]
    assert fit.pick_device(snap, "auto") is b70


def test_garbage_fdinfo_lines_are_skipped(tree: Path) -> None:
    garbage = [
        "nonsense without a colon",
        "drm-total-vram0:\tlots",
        "drm-resident-vram1:\t12 TiB",
        ":::",
        "\x01\x02",
    ]
    proc = t.llama_server()
    proc.clients[0].extra_lines = garbage
    t.build(tree, [t.Card(t.B70)], [proc])
    ((_, held),) = gpu.snapshot(tree).devices[0].holders
    assert held == 22 * GIB
    assert fdinfo.parse_fdinfo("pos:\t0\nflags:\t02\n") is None  # not a DRM client
    client = fdinfo.parse_fdinfo("drm-driver:\txe\ndrm-resident-vram0:\tmany\n")
    assert client is not None and client.resident_vram_bytes == 0


def test_duplicated_drm_fds_count_once(tree: Path) -> None:
    proc = t.llama_server()
    proc.clients.append(
        t.Client(fd=8, slot=t.B70, client_id=12, resident=proc.clients[0].resident)
    )  # dup()
    child = t.Proc(
        4243, ["llama-server-worker"], t.LLAMA_CGROUP, [proc.clients[0]]
    )  # fork() inherits
    t.build(tree, [t.Card(t.B70)], [proc, child])
    (mem,) = gpu.snapshot(tree).devices
    assert [(h.pid, b) for h, b in mem.holders] == [(4242, 22 * GIB)]


def test_used_is_unknown_without_cap_perfmon(tree: Path) -> None:
    t.build(tree, [t.Card(t.B70, vram_used=0)], [t.llama_server()], caps=t.USER_CAPS)
    (mem,) = gpu.snapshot(tree).devices
    assert mem.used_bytes is None
    assert mem.free_bytes == 10 * GIB  # estimated: total minus what the holders hold


@pytest.fixture
def readable_tree() -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="b70-gpu-"))
    top.chmod(0o755)
    yield top / "root"
    shutil.rmtree(top)


def test_proc_entries_of_other_users_cannot_be_read(readable_tree: Path) -> None:
    hidden = t.foreign(pid=7000)
    hidden.unreadable = True
    t.build(readable_tree, [t.Card(t.B70)], [t.llama_server(), hidden])
    # As an unprivileged user the root-owned fd directory of pid 7000 cannot be listed.
    code = (
        "import json, sys; from pathlib import Path; from appliance.host.gpu import fdinfo; "
        "s = fdinfo.read_holders(Path(sys.argv[1])); "
        "print(json.dumps([s.unreadable_pids, [h.pid for h in s.holders]]))"
    )
    out = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            code,
            str(readable_tree),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    assert json.loads(out.stdout) == [1, [4242]]


SETPRIV_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_a_gpu_client_whose_fdinfo_is_withheld_is_counted_as_unreadable(
    readable_tree: Path,
) -> None:
    # An LSM may let a process's fd directory be listed and still refuse its fdinfo: the VRAM it
    # holds must not silently vanish.
    t.build(readable_tree, [t.Card(t.B70)], [t.llama_server(), t.foreign(pid=7000)])
    (readable_tree / "proc" / "7000" / "fdinfo").chmod(0o700)
    code = (
        "import json, sys; from pathlib import Path; from appliance.host.gpu import fdinfo; "
        "s = fdinfo.read_holders(Path(sys.argv[1])); "
        "print(json.dumps([s.unreadable_pids, [h.pid for h in s.holders]]))"
    )
    out = subprocess.run(
        [*SETPRIV_NOBODY, sys.executable, "-c", code, str(readable_tree)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    assert json.loads(out.stdout) == [1, [4242]]


def test_fdinfo_that_cannot_be_read_as_root_either(tree: Path) -> None:
    t.build(tree, [t.Card(t.B70)], [t.llama_server(), t.foreign(pid=7000)])
    fd_file = tree / "proc" / "7000" / "fdinfo" / "9"
    fd_file.unlink()
    fd_file.mkdir()  # read() fails with EISDIR while the fd is still open
    scan = fdinfo.read_holders(tree)
    assert scan.unreadable_pids == 1 and [h.pid for h in scan.holders] == [4242]
    assert "1 processes could not be read" in b70ctl("gpu", "--root", str(tree)).stdout
