"""What the controller keeps between runs: the switch lock and the switch records."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.render import Layout, write_atomic

LOCK_FILE = "switch.lock"
LOCK_TRIES = 20
LAST_SWITCH = "last-switch.json"
HISTORY = "switches.jsonl"


@contextmanager
def switch_lock(state_dir: Path, target: str) -> Iterator[None]:
    """One switch at a time. A second caller is told who holds the lock."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        holder = None
        for attempt in range(LOCK_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # The monitor tests the lock with a brief shared lock, which leaves no details.
                if os.pread(fd, 1, 0) or attempt == LOCK_TRIES - 1:
                    holder = _read_holder(fd)
                    break
                time.sleep(0.05)
        if holder is not None:
            raise ApplianceError(
                f"another switch is running: {holder}",
                hint="wait for it to finish; `b70ctl status` shows the result",
                code="switch_in_progress",
                exit_code=3,
            ) from None
        info = {"pid": os.getpid(), "target": target, "started_at": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        age = time.time() - float(info["started_at"])
        return f"to {info['target']} (pid {info['pid']}, started {age:.0f} s ago)"
    except (ValueError, KeyError, TypeError):
        return "(its details are not written yet)"


def record_switch(state_dir: Path, record: dict[str, Any]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True)
    write_atomic(state_dir / LAST_SWITCH, line + "\n")
    with open(state_dir / HISTORY, "a") as f:
        f.write(line + "\n")


def last_switch(state_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((state_dir / LAST_SWITCH).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_key(lay: Layout) -> str:
    try:
        text = lay.key_file.read_text()
    except FileNotFoundError:
        raise ApplianceError(
            f"the proxy key file {lay.key_file} does not exist",
            hint="run `b70ctl install`",
            code="not_installed",
        ) from None
    except PermissionError:
        raise ApplianceError(
            f"cannot read the proxy key file {lay.key_file}",
            hint="run as root (or with --user)",
            code="permission_denied",
        ) from None
    for line in text.splitlines():
        if line.startswith("LITELLM_MASTER_KEY="):
            return line.split("=", 1)[1].strip()
    raise ApplianceError(
        f"{lay.key_file} holds no LITELLM_MASTER_KEY=",
        hint="delete it and run `b70ctl install`",
        code="not_installed",
    )


def ensure_key(lay: Layout) -> bool:
    if lay.key_file.exists():
        return False
    key = "sk-b70-" + secrets.token_urlsafe(32)
    write_atomic(lay.key_file, f"LITELLM_MASTER_KEY={key}\n", mode=0o600)
    return True
