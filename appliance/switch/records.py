"""The switch records: the last switch, for `status`, and every switch, oldest first, for the
status page and the metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from appliance.files import write_atomic
from appliance.layout import HISTORY, LAST_SWITCH


def record_switch(state_dir: Path, record: dict[str, Any]) -> str | None:
    """Keep a switch's outcome for `status`; what kept it from being written, or None.

    Never raises: the switch has happened by now, and a full file system must not turn it
    into a failure, nor hide the failure it records."""
    line = json.dumps(record, sort_keys=True)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(state_dir / LAST_SWITCH, line + "\n")
        with open(state_dir / HISTORY, "a") as f:
            f.write(line + "\n")
    except OSError as e:
        why = e.strerror or str(e)
        return f"this switch was not recorded in {state_dir}: {why}; `status` shows the one before"
    return None


def read_history(state_dir: Path) -> list[dict[str, Any]]:
    """Every switch record, oldest first; lines that do not parse are skipped."""
    try:
        lines = (state_dir / HISTORY).read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def last_switch(state_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((state_dir / LAST_SWITCH).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
