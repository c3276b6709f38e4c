"""Builders of fixture trees in the kernel's exact formats: sysfs DRM cards, /dev/dri render nodes
(holding the xe memory-region query reply in its uapi layout), and /proc entries with DRM fdinfo.

Formats: sysfs `vendor`/`device` are "0x8086\\n"; `uevent` is KEY=VALUE lines; /sys/class/drm/cardN
links to the PCI device's drm/cardN, whose `device` links back to the PCI device; fdinfo is
"key:\\tvalue" lines (drm-usage-stats), sizes in bytes or with KiB/MiB units; /proc/PID/cgroup is
cgroup v2 ("0::/path"); cmdline is NUL-separated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from appliance.host.gpu import xe

GIB = 1024**3
ROOT_CAPS = "000001ffffffffff"  # root: every capability, CAP_PERFMON (38) included
USER_CAPS = "0000000000000000"


@dataclass
class Card:
    slot: str
    vendor: int = 0x8086
    device: int = 0xE223
    driver: str = "xe"
    card: str = "card1"
    render: str | None = "renderD128"
    vram_total: int = 32 * GIB
    vram_used: int = 300 * 1024**2  # the driver's own buffers
    sysmem_total: int = 62 * GIB


@dataclass
class Client:
    fd: int
    slot: str
    client_id: int
    resident: str  # as the kernel prints it: "23068672 KiB", "512 MiB", "4096"
    render: str = "renderD128"
    extra_lines: list[str] = field(default_factory=list)


@dataclass
class Proc:
    pid: int
    cmdline: list[str]
    cgroup: str
    clients: list[Client] = field(default_factory=list)
    unreadable: bool = False


def mem_regions_reply(card: Card) -> bytes:
    """struct drm_xe_query_mem_regions with a sysmem and a vram0 region, as the kernel fills it."""
    header = xe.MEM_REGIONS_HEADER.pack(2, 0)
    sysmem = xe.MEM_REGION.pack(0, 0, 4096, card.sysmem_total, 0, 0, 0, *[0] * 6)
    vram = xe.MEM_REGION.pack(
        1, 0, 4096, card.vram_total, card.vram_used, card.vram_total, card.vram_used, *[0] * 6
    )
    return header + sysmem + vram


def fdinfo_text(c: Client, driver: str = "xe") -> str:
    lines = [
        "pos:\t0",
        "flags:\t02100002",
        "mnt_id:\t29",
        f"ino:\t{1000 + c.fd}",
        f"drm-driver:\t{driver}",
        f"drm-client-id:\t{c.client_id}",
        f"drm-pdev:\t{c.slot}",
        "drm-total-system:\t0",
        "drm-shared-system:\t0",
        "drm-active-system:\t0",
        "drm-resident-system:\t0",
        "drm-purgeable-system:\t0",
        "drm-total-gtt:\t8 KiB",
        "drm-shared-gtt:\t0",
        "drm-active-gtt:\t0",
        "drm-resident-gtt:\t8 KiB",
        f"drm-total-vram0:\t{c.resident}",
        "drm-shared-vram0:\t0",
        "drm-active-vram0:\t0",
        f"drm-resident-vram0:\t{c.resident}",
        "drm-purgeable-vram0:\t0",
        "drm-cycles-rcs:\t28257900",
        "drm-total-cycles-rcs:\t7655183225",
        *c.extra_lines,
    ]
    return "\n".join(lines) + "\n"


def build(root: Path, cards: list[Card], procs: list[Proc], caps: str = ROOT_CAPS) -> Path:
    for card in cards:
        pci = root / "sys" / "devices" / "pci0000:00" / "0000:00:01.0" / card.slot
        pci.mkdir(parents=True, exist_ok=True)
        (pci / "vendor").write_text(f"{card.vendor:#06x}\n")
        (pci / "device").write_text(f"{card.device:#06x}\n")
        (pci / "uevent").write_text(
            f"DRIVER={card.driver}\nPCI_CLASS=30000\n"
            f"PCI_ID={card.vendor:04X}:{card.device:04X}\nPCI_SUBSYS_ID={card.vendor:04X}:1000\n"
            f"PCI_SLOT_NAME={card.slot}\n"
            f"MODALIAS=pci:v0000{card.vendor:04X}d0000{card.device:04X}sv00008086sd00001000bc03sc00i00\n"
        )
        klass = root / "sys" / "class" / "drm"
        klass.mkdir(parents=True, exist_ok=True)
        for node in [card.card, card.render]:
            if node is None:
                continue
            (pci / "drm" / node).mkdir(parents=True)
            os.symlink(f"../../../{card.slot}", pci / "drm" / node / "device")
            os.symlink(
                f"../../devices/pci0000:00/0000:00:01.0/{card.slot}/drm/{node}", klass / node
            )
        dri = root / "dev" / "dri"
        dri.mkdir(parents=True, exist_ok=True)
        if card.render and card.driver == "xe":
            (dri / card.render).write_bytes(mem_regions_reply(card))
    proc = root / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "status").write_text(
        f"Name:\tb70ctl\nUid:\t0\t0\t0\t0\nCapInh:\t0000000000000000\nCapPrm:\t{caps}\nCapEff:\t{caps}\n"
    )
    for p in procs:
        add_proc(root, p)
    return root


def add_proc(root: Path, p: Proc) -> None:
    d = root / "proc" / str(p.pid)
    (d / "fd").mkdir(parents=True)
    (d / "fdinfo").mkdir()
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in p.cmdline) + b"\0")
    (d / "cgroup").write_text(f"0::{p.cgroup}\n")
    for fd in (0, 1, 2):
        os.symlink("/dev/null", d / "fd" / str(fd))
        (d / "fdinfo" / str(fd)).write_text("pos:\t0\nflags:\t02\nmnt_id:\t25\nino:\t5\n")
    for c in p.clients:
        os.symlink(f"/dev/dri/{c.render}", d / "fd" / str(c.fd))
        (d / "fdinfo" / str(c.fd)).write_text(fdinfo_text(c))
    if p.unreadable:
        os.chmod(d / "fd", 0o500)  # only the owner (root) may read it
        os.chmod(d / "fdinfo", 0o500)


B70 = "0000:03:00.0"
B70_2 = "0000:83:00.0"
LLAMA_CGROUP = "/system.slice/b70-llamacpp.service"
VLLM_CGROUP = "/system.slice/b70-vllm.service"
FOREIGN_CGROUP = "/user.slice/user-1000.slice/session-3.scope"


def llama_server(
    pid: int = 4242, resident: str = f"{22 * 1024 * 1024} KiB", slot: str = B70
) -> Proc:
    return Proc(
        pid,
        ["/opt/llama.cpp/bin/llama-server", "--model", "/srv/b70/models/q.gguf", "-ngl", "99"],
        LLAMA_CGROUP,
        [Client(fd=7, slot=slot, client_id=12, resident=resident)],
    )


def foreign(pid: int = 5151, resident: str = "20480 MiB") -> Proc:
    return Proc(
        pid,
        ["python3", "train.py", "--epochs", "3"],
        FOREIGN_CGROUP,
        [Client(fd=9, slot=B70, client_id=31, resident=resident)],
    )


def healthy_host(root: Path, slots: list[str], memory_kib: int = 64 * 1024**2) -> Path:
    """A B70 host as `b70ctl doctor` wants it: B70s under xe at `slots` with their
    /dev/dri/by-path links, kernel 7.1, the render group (with the b70 user), root's
    capabilities, and `memory_kib` of memory."""
    cards = [
        Card(slot, card=f"card{i + 1}", render=f"renderD{128 + i}") for i, slot in enumerate(slots)
    ]
    build(root, cards, [])
    files = {
        "proc/sys/kernel/osrelease": "7.1.0-b70\n",
        "proc/meminfo": f"MemTotal:       {memory_kib} kB\nMemFree:        1024 kB\n",
        "etc/group": "root:x:0:\nrender:x:105:b70\n",
        "etc/passwd": "root:x:0:0::/root:/bin/sh\nb70:x:990:990::/var/lib/b70:/bin/false\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    by_path = root / "dev" / "dri" / "by-path"
    by_path.mkdir(parents=True, exist_ok=True)
    for card in cards:
        os.symlink(f"../{card.render}", by_path / f"pci-{card.slot}-render")
    return root
