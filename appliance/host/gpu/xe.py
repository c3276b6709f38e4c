"""The xe driver's memory-region query (DRM_IOCTL_XE_DEVICE_QUERY, DRM_XE_DEVICE_QUERY_MEM_REGIONS)
on a render node, in the byte layout of include/uapi/drm/xe_drm.h."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from appliance.host.gpu.sysfs import read_text

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


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (DRM_IOCTL_BASE << 8) | nr


DRM_IOCTL_XE_DEVICE_QUERY = _iowr(DRM_COMMAND_BASE + DRM_XE_DEVICE_QUERY, DEVICE_QUERY.size)


@dataclass(frozen=True)
class Region:
    """One memory region of an xe device, from DRM_XE_DEVICE_QUERY_MEM_REGIONS."""

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
    reliable = has_perfmon(read_text(root / "proc" / "self" / "status") or "")
    if path.is_file():
        return parse_mem_regions(path.read_bytes(), reliable)
    import ctypes  # a buffer with an address, for the real ioctl only
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
