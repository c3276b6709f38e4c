"""GPU memory: which Intel GPUs there are, how much VRAM each has and uses, and who holds it.

Sources, best first:
- the xe device-query ioctl on the render node (DRM_XE_DEVICE_QUERY_MEM_REGIONS): total and used
  per region; `used` reads 0 unless the caller has CAP_PERFMON or CAP_SYS_ADMIN, so without them
  it is reported as unknown (None), never as 0;
- DRM fdinfo (/proc/PID/fdinfo/FD): per-client `drm-resident-vram0`, counted once per
  (drm-pdev, drm-client-id), attributed to a process and, through its cgroup, to a systemd unit;
- device discovery from sysfs (/sys/class/drm/cardN/device: vendor, device, uevent).

Parsers take text or bytes; readers take a filesystem root, so tests run on fixture trees in the
kernel's exact formats. Unknown values are None, never "unknown" or -1.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

INTEL_VENDOR = 0x8086
# BMG-G31 (Arc Pro B70 is e223); the xe driver binds them.
B70_DEVICE_IDS = frozenset({0xE220, 0xE221, 0xE222, 0xE223})
KNOWN_NAMES = {0xE223: "Intel Arc Pro B70"}

# include/uapi/drm/xe_drm.h
DRM_IOCTL_BASE = ord("d")
DRM_COMMAND_BASE = 0x40
DRM_XE_DEVICE_QUERY = 0x00
DRM_XE_DEVICE_QUERY_MEM_REGIONS = 1
DRM_XE_MEM_REGION_CLASS_SYSMEM = 0
DRM_XE_MEM_REGION_CLASS_VRAM = 1
# struct drm_xe_device_query { __u64 extensions; __u32 query; __u32 size; __u64 data;
#                              __u64 reserved[2]; }
DEVICE_QUERY = struct.Struct("<QIIQ2Q")
# struct drm_xe_query_mem_regions { __u32 num_mem_regions; __u32 pad; regions[] }
MEM_REGIONS_HEADER = struct.Struct("<II")
# struct drm_xe_mem_region { __u16 mem_class; __u16 instance; __u32 min_page_size;
#   __u64 total_size; __u64 used; __u64 cpu_visible_size; __u64 cpu_visible_used;
#   __u64 reserved[6]; }
MEM_REGION = struct.Struct("<HHIQQQQ6Q")

CAP_SYS_ADMIN = 21
CAP_PERFMON = 38


def sysroot() -> Path:
    """Where sysfs, /proc and /dev are read; B70_SYSROOT points at a fixture tree instead."""
    return Path(os.environ.get("B70_SYSROOT") or "/")


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (DRM_IOCTL_BASE << 8) | nr


DRM_IOCTL_XE_DEVICE_QUERY = _iowr(DRM_COMMAND_BASE + DRM_XE_DEVICE_QUERY, DEVICE_QUERY.size)


# --- devices (sysfs) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    pci_slot: str
    vendor_id: int
    device_id: int
    driver: str | None
    card: str | None
    render_node: str | None

    @property
    def is_intel(self) -> bool:
        return self.vendor_id == INTEL_VENDOR

    @property
    def is_b70(self) -> bool:
        return self.is_intel and self.device_id in B70_DEVICE_IDS

    @property
    def name(self) -> str | None:
        return KNOWN_NAMES.get(self.device_id) if self.is_intel else None


def parse_uevent(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _hex(text: str | None) -> int | None:
    try:
        return int(text.strip(), 16) if text else None
    except ValueError:
        return None


def read_devices(root: Path = Path("/")) -> list[Device]:
    """Every DRM card under root/sys/class/drm with its PCI identity (Intel or not)."""
    drm = root / "sys" / "class" / "drm"
    if not drm.is_dir():
        return []
    renders: dict[str, str] = {}
    cards: dict[str, str] = {}
    for entry in sorted(drm.iterdir()):
        if re.fullmatch(r"renderD\d+", entry.name):
            slot = _pci_slot(entry / "device")
            if slot:
                renders.setdefault(slot, entry.name)
        elif re.fullmatch(r"card\d+", entry.name):
            slot = _pci_slot(entry / "device")
            if slot:
                cards.setdefault(slot, entry.name)
    devices = []
    for slot, card in sorted(cards.items()):
        dev = drm / card / "device"
        vendor, device = _hex(_read(dev / "vendor")), _hex(_read(dev / "device"))
        if vendor is None or device is None:
            continue
        uevent = parse_uevent(_read(dev / "uevent") or "")
        devices.append(Device(slot, vendor, device, uevent.get("DRIVER"), card, renders.get(slot)))
    return devices


def _pci_slot(device_dir: Path) -> str | None:
    uevent = parse_uevent(_read(device_dir / "uevent") or "")
    slot = uevent.get("PCI_SLOT_NAME")
    if slot:
        return slot
    try:
        name = os.readlink(device_dir).rstrip("/").rsplit("/", 1)[-1]
    except OSError:
        return None
    return name if re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", name) else None


# --- the xe memory-region query ----------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    mem_class: int
    instance: int
    total_bytes: int
    used_bytes: int | None  # None: the caller lacks CAP_PERFMON, so the kernel reported 0

    @property
    def is_vram(self) -> bool:
        return self.mem_class == DRM_XE_MEM_REGION_CLASS_VRAM


def pack_device_query(query: int, size: int, data: int) -> bytes:
    return DEVICE_QUERY.pack(0, query, size, data, 0, 0)


def parse_mem_regions(buf: bytes, used_is_reliable: bool) -> list[Region]:
    if len(buf) < MEM_REGIONS_HEADER.size:
        raise ValueError(f"memory-region reply of {len(buf)} bytes is shorter than its header")
    count, _pad = MEM_REGIONS_HEADER.unpack_from(buf, 0)
    need = MEM_REGIONS_HEADER.size + count * MEM_REGION.size
    if len(buf) < need:
        raise ValueError(f"memory-region reply claims {count} regions but has {len(buf)} bytes")
    regions = []
    for i in range(count):
        fields = MEM_REGION.unpack_from(buf, MEM_REGIONS_HEADER.size + i * MEM_REGION.size)
        mem_class, instance, _page, total, used = fields[:5]
        regions.append(Region(mem_class, instance, total, used if used_is_reliable else None))
    return regions


def has_perfmon(status_text: str) -> bool:
    """Whether CapEff in /proc/self/status holds CAP_PERFMON or CAP_SYS_ADMIN."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            caps = int(line.split()[1], 16)
            return bool(caps & (1 << CAP_PERFMON) or caps & (1 << CAP_SYS_ADMIN))
    return False


def query_mem_regions(root: Path, render_node: str) -> list[Region]:
    """Ask the xe driver for its memory regions (two ioctls: the size, then the data).

    In a fixture tree the render node is a regular file holding the reply's bytes, in the uapi
    layout; a real one is a character device and gets the ioctl.
    """
    path = root / "dev" / "dri" / render_node
    reliable = has_perfmon(_read(root / "proc" / "self" / "status") or "")
    if path.is_file():
        return parse_mem_regions(path.read_bytes(), reliable)
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        probe = bytearray(pack_device_query(DRM_XE_DEVICE_QUERY_MEM_REGIONS, 0, 0))
        fcntl.ioctl(fd, DRM_IOCTL_XE_DEVICE_QUERY, probe)
        size = DEVICE_QUERY.unpack(probe)[2]
        data = ctypes.create_string_buffer(size)
        address = ctypes.addressof(data)
        request = bytearray(pack_device_query(DRM_XE_DEVICE_QUERY_MEM_REGIONS, size, address))
        fcntl.ioctl(fd, DRM_IOCTL_XE_DEVICE_QUERY, request)
        return parse_mem_regions(data.raw[:size], reliable)
    finally:
        os.close(fd)


# --- DRM fdinfo --------------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_SIZE_RE = re.compile(r"^(\d+)\s*(B|KiB|MiB|GiB)?$")


def parse_size(text: str) -> int | None:
    m = _SIZE_RE.match(text.strip())
    return int(m.group(1)) * _UNITS[m.group(2) or ""] if m else None


@dataclass(frozen=True)
class DrmClient:
    driver: str
    pdev: str | None
    client_id: str | None
    resident_vram_bytes: int
    total_vram_bytes: int


def parse_fdinfo(text: str) -> DrmClient | None:
    """One fdinfo file; None unless it is a DRM client. Lines that do not parse are skipped."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.startswith("drm-"):
            values[key.strip()] = value.strip()
    driver = values.get("drm-driver")
    if not driver:
        return None
    resident = total = 0
    for key, value in values.items():
        size = parse_size(value)
        if size is None:
            continue
        if re.fullmatch(r"drm-resident-vram\d+", key):
            resident += size
        elif re.fullmatch(r"drm-total-vram\d+", key):
            total += size
    return DrmClient(driver, values.get("drm-pdev"), values.get("drm-client-id"), resident, total)


def parse_cgroup_unit(text: str) -> str | None:
    """The systemd unit of a process from /proc/PID/cgroup (the deepest *.service or *.scope)."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0":
            for component in reversed(parts[2].split("/")):
                if component.endswith((".service", ".scope")):
                    return component
    return None


@dataclass
class Holder:
    pid: int
    command: str | None
    unit: str | None
    vram_bytes: dict[str, int] = field(default_factory=dict)  # by drm-pdev


@dataclass
class ProcScan:
    holders: list[Holder]
    unreadable_pids: int


def read_holders(root: Path = Path("/")) -> ProcScan:
    """Every process with DRM clients that hold VRAM, each client counted once."""
    proc = root / "proc"
    seen: set[tuple[str | None, str | None]] = set()
    holders: list[Holder] = []
    unreadable = 0
    for pid_dir in _pid_dirs(proc):
        try:
            fds = os.listdir(pid_dir / "fd")
        except PermissionError:
            unreadable += 1
            continue
        except OSError:
            continue  # exited while we looked
        holder: Holder | None = None
        hidden = False
        for fd in fds:
            client = _drm_client(pid_dir, fd)
            if client is UNREADABLE:
                hidden = True  # a GPU client whose memory we may not see: say so, never 0
                continue
            if not isinstance(client, DrmClient) or client.resident_vram_bytes == 0:
                continue
            key = (client.pdev, client.client_id)
            if client.client_id is not None and key in seen:
                continue  # a dup()ed or inherited fd of a client already counted
            seen.add(key)
            if holder is None:
                holder = Holder(int(pid_dir.name), _command(pid_dir), _unit(pid_dir))
                holders.append(holder)
            pdev = client.pdev or "?"
            holder.vram_bytes[pdev] = holder.vram_bytes.get(pdev, 0) + client.resident_vram_bytes
        unreadable += hidden
    return ProcScan(holders, unreadable)


def _pid_dirs(proc: Path) -> Iterable[Path]:
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    return [
        proc / n for n in sorted(names, key=lambda n: int(n) if n.isdigit() else 0) if n.isdigit()
    ]


UNREADABLE = object()  # a DRM fd whose fdinfo exists but may not be read


def _drm_client(pid_dir: Path, fd: str) -> DrmClient | object | None:
    """The DRM client behind one fd; None when it is none (or gone), UNREADABLE when hidden.

    A listable fd directory does not mean a readable fdinfo: an LSM, or the kernel's ptrace
    check, may refuse the one and not the other.
    """
    link = pid_dir / "fd" / fd
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        return None  # closed while we looked
    except OSError:
        return UNREADABLE
    if not target.startswith("/dev/dri/"):
        return None
    try:
        text = (pid_dir / "fdinfo" / fd).read_text(errors="replace")
    except OSError:
        # The fd is still there (not a race with close or exit): its fdinfo is being withheld.
        return UNREADABLE if os.path.lexists(link) else None
    return parse_fdinfo(text)


def _command(pid_dir: Path) -> str | None:
    try:
        raw = (pid_dir / "cmdline").read_bytes()
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace") or None


def _unit(pid_dir: Path) -> str | None:
    text = _read(pid_dir / "cgroup")
    return parse_cgroup_unit(text) if text else None


# --- one snapshot ------------------------------------------------------------------------------


@dataclass
class DeviceMemory:
    device: Device
    total_bytes: int | None
    used_bytes: int | None
    source: str  # "xe-query", "fdinfo" or "none"
    holders: list[tuple[Holder, int]]  # (holder, bytes on this device)
    error: str | None = None

    @property
    def held_bytes(self) -> int:
        return sum(b for _, b in self.holders)

    @property
    def free_bytes(self) -> int | None:
        if self.total_bytes is None:
            return None
        used = self.used_bytes if self.used_bytes is not None else self.held_bytes
        return max(self.total_bytes - used, 0)


@dataclass
class Snapshot:
    devices: list[DeviceMemory]
    unreadable_pids: int
    ignored: list[Device]  # DRM cards that are not Intel


def snapshot(root: Path = Path("/")) -> Snapshot:
    """Every Intel GPU with its VRAM and who holds it."""
    all_devices = read_devices(root)
    intel = [d for d in all_devices if d.is_intel]
    scan = read_holders(root) if intel else ProcScan([], 0)
    out = []
    for dev in intel:
        on_dev = [
            (h, h.vram_bytes[dev.pci_slot]) for h in scan.holders if dev.pci_slot in h.vram_bytes
        ]
        mem = DeviceMemory(dev, None, None, "fdinfo", on_dev)
        if dev.driver == "xe" and dev.render_node:
            try:
                vram = [r for r in query_mem_regions(root, dev.render_node) if r.is_vram]
            except (OSError, ValueError) as e:
                mem.error = f"xe query on {dev.render_node}: {e}"
            else:
                if vram:
                    mem.source = "xe-query"
                    mem.total_bytes = sum(r.total_bytes for r in vram)
                    used = [r.used_bytes for r in vram]
                    mem.used_bytes = None if None in used else sum(u or 0 for u in used)
        if mem.total_bytes is None and root == Path("/"):
            _from_sysman(mem)
        out.append(mem)
    return Snapshot(out, scan.unreadable_pids, [d for d in all_devices if not d.is_intel])


def _from_sysman(mem: DeviceMemory) -> None:
    """Level Zero Sysman, when the xe query gave nothing (it is optional: see sysman.py)."""
    from appliance.sysman import read_sysman

    result = read_sysman()
    found = result.memory.get(mem.device.pci_slot)
    if found is None:
        if result.unavailable and mem.error:
            mem.error += f"; Level Zero: {result.unavailable}"
        return
    mem.source, mem.total_bytes, mem.used_bytes = "sysman", found.total_bytes, found.used_bytes
