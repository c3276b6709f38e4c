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

import os
from dataclasses import dataclass
from pathlib import Path

from appliance.host.gpu.fdinfo import Holder, ProcScan, read_holders
from appliance.host.gpu.sysfs import Device, read_devices
from appliance.host.gpu.xe import query_mem_regions

__all__ = ["Device", "DeviceMemory", "Holder", "Snapshot", "snapshot", "sysroot"]


def sysroot() -> Path:
    """Where sysfs, /proc and /dev are read; B70_SYSROOT points at a fixture tree instead."""
    return Path(os.environ.get("B70_SYSROOT") or "/")


@dataclass
class DeviceMemory:
    """One card's memory: total, used, where the figures came from, who holds it."""

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
    def in_use_bytes(self) -> int:
        """Used, as the driver reports it; where it cannot, what the processes hold."""
        return self.used_bytes if self.used_bytes is not None else self.held_bytes

    @property
    def free_bytes(self) -> int | None:
        if self.total_bytes is None:
            return None
        return max(self.total_bytes - self.in_use_bytes, 0)


@dataclass
class Snapshot:
    """Every card's memory at one moment."""

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
    from appliance.host.gpu.sysman import read_sysman

    result = read_sysman()
    found = result.memory.get(mem.device.pci_slot)
    if found is None:
        if result.unavailable and mem.error:
            mem.error += f"; Level Zero: {result.unavailable}"
        return
    mem.source, mem.total_bytes, mem.used_bytes = "sysman", found.total_bytes, found.used_bytes
