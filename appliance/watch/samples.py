"""The monitor's files: its samples, kept on disk as a bounded ring (the last hour, for the
status page), and its record, what it saved of itself (layout.MONITOR_RECORD, for `status`).

One JSON line per sample in the state directory (layout.SAMPLES), appended with O_APPEND so
that a reader never sees half a line; once the oldest line is more than SLACK_S past the hour,
the file is written anew, atomically, with the last hour only. So the file holds between one
hour and one hour plus SLACK_S of samples, and a monitor that restarts keeps them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from appliance.files import write_atomic
from appliance.layout import MONITOR_RECORD, SAMPLES

KEEP_S = 3600.0
SLACK_S = 300.0


def sample_of(observed: list[Any], held_now: int, snap: Any) -> dict[str, Any]:
    """One line of the ring: each runtime watched and its work (several serve side by side on
    their own cards), requests held, and VRAM per card. `runtime` names the first by name, and
    `state` is its unit's ActiveState (the key the status page reads); `healthy` says every
    serving runtime is; `in_flight` is the sum of those known."""
    cards = []
    for mem in snap.devices:
        units: dict[str, int] = {}
        for holder, held in mem.holders:
            key = holder.unit or f"pid {holder.pid}"
            units[key] = units.get(key, 0) + held
        cards.append(
            {
                "pci": mem.device.pci_slot,
                "used": mem.in_use_bytes,
                "total": mem.total_bytes,
                "units": units,
            }
        )
    first = observed[0]
    watched = [o for o in observed if o.runtime is not None]
    serving = [o for o in watched if o.active_state == "active"]
    known = [o.in_flight for o in watched if o.in_flight is not None]
    return {
        "t": round(first.at, 3),
        "runtime": first.runtime,
        "state": first.active_state,
        "healthy": bool(serving) and all(o.healthy for o in serving),
        "switching": first.switching,
        "in_flight": sum(known) if known else None,
        "runtimes": {
            o.runtime: {
                "state": o.active_state,
                "healthy": o.healthy,
                "in_flight": o.in_flight,
                "generated": o.generated,  # tokens since it started: tokens/s between samples
            }
            for o in watched
        },
        "held": held_now,
        "cards": cards,
    }


def append(state_dir: Path, sample: dict[str, Any], now: float | None = None) -> None:
    """Add a sample; drop what is older than the hour once there is SLACK_S of it."""
    path = state_dir / SAMPLES
    line = json.dumps(sample, separators=(",", ":")) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    now = time.time() if now is None else now
    oldest = _first_time(path)
    if oldest is not None and oldest < now - KEEP_S - SLACK_S:
        kept = [s for s in read(state_dir) if s["t"] >= now - KEEP_S]
        write_atomic(path, "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in kept))


def _first_time(path: Path) -> float | None:
    try:
        with path.open("rb") as f:
            first = f.readline()
        t = json.loads(first)["t"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(t) if isinstance(t, int | float) else None


def read(state_dir: Path, since: float | None = None) -> list[dict[str, Any]]:
    """The samples, oldest first (after `since`, if given); lines that do not parse are skipped."""
    try:
        text = (state_dir / SAMPLES).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            sample = json.loads(line)
        except ValueError:
            continue
        timed = isinstance(sample, dict) and isinstance(sample.get("t"), int | float)
        if timed and (since is None or sample["t"] > since):
            out.append(sample)
    return out


def read_monitor(state_dir: Path) -> dict[str, Any] | None:
    """The monitor's record: what it last saved of itself (its counters, last observation and
    action)."""
    try:
        data = json.loads((state_dir / MONITOR_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
