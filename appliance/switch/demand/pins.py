"""A pin: `b70ctl switch NAME --pin DURATION` keeps NAME serving against demand until the pin
ends, or until `b70ctl unpin`. A pin holds demand off, nothing else: a switch by hand and the
monitor's failover still switch (and a switch by hand to another runtime ends the pin)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import ApplianceError
from appliance.files import write_atomic

PIN_FILE = "pin.json"
UNITS_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")
MOST_S = 30 * 86400.0


@dataclass(frozen=True)
class Pin:
    runtime: str
    until: float  # epoch seconds

    def left_s(self, now: float) -> float:
        return max(0.0, self.until - now)


def parse_duration(text: str, option: str = "--pin", most_s: float = MOST_S) -> float:
    """Seconds from "90", "90s", "30m", "2h" or "1d"."""
    match = DURATION_RE.fullmatch(text.strip())
    seconds = float(match.group(1)) * UNITS_S[match.group(2)] if match else 0.0
    if not match or not 0 < seconds <= most_s:
        raise ApplianceError(
            f"{option} {text!r} is not a duration the appliance takes",
            hint=f"a number with s, m, h or d, from 1 s to {most_s / 86400:g} d: e.g. "
            f"{option} 30m, {option} 2h",
            code="usage_error",
            exit_code=2,
        )
    return seconds


def write_pin(state_dir: Path, runtime: str, seconds: float) -> Pin:
    pin = Pin(runtime, time.time() + seconds)
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(state_dir / PIN_FILE, json.dumps(pin.__dict__) + "\n")
    return pin


def read_pin(state_dir: Path, now: float | None = None) -> Pin | None:
    """The pin that holds now; None when there is none, it ended, or its file is not a pin."""
    try:
        data = json.loads((state_dir / PIN_FILE).read_text())
        pin = Pin(str(data["runtime"]), float(data["until"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pin if pin.until > (time.time() if now is None else now) else None


def clear_pin(state_dir: Path) -> Pin | None:
    """Remove the pin; the one that held, if one did."""
    pin = read_pin(state_dir)
    (state_dir / PIN_FILE).unlink(missing_ok=True)
    return pin
