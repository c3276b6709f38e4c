"""Who holds GPU memory: DRM fdinfo (/proc/PID/fdinfo/FD), per client, attributed to a process
and, through its cgroup, to a systemd unit."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from appliance.host.gpu.sysfs import read_text

_UNITS = {"": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_SIZE_RE = re.compile(r"^(\d+)\s*(B|KiB|MiB|GiB)?$")


def parse_size(text: str) -> int | None:
    m = _SIZE_RE.match(text.strip())
    return int(m.group(1)) * _UNITS[m.group(2) or ""] if m else None


@dataclass(frozen=True)
class DrmClient:
    """One DRM client of a process, from its fdinfo: driver, device and VRAM."""

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
    """A process holding GPU memory: pid, command, unit, bytes per card."""

    pid: int
    command: str | None
    unit: str | None
    vram_bytes: dict[str, int] = field(default_factory=dict)  # by drm-pdev


@dataclass
class ProcScan:
    """The holders found in /proc, and the processes that could not be read."""

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
    text = read_text(pid_dir / "cgroup")
    return parse_cgroup_unit(text) if text else None
