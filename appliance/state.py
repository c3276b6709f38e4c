"""What the controller keeps between runs: the switch lock and the switch records."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.files import write_atomic
from appliance.layout import HISTORY, LAST_SWITCH, LOCK_FILE, Layout
from appliance.proxy.hold import start_time

LOCK_TRIES = 20


class SwitchLock:
    """The held lock of a running switch. Its file says who holds it and how far it got, so a
    switch that is killed (SIGKILL: no cleanup runs) leaves a trace the next command finds."""

    def __init__(self, fd: int, info: dict[str, Any], stale: dict[str, Any] | None) -> None:
        self.fd = fd
        self.info = info
        # What a killed switch left in the file before this one took the lock, if anything.
        self.stale = stale
        self.unwritten: str | None = None

    def note(self, **fields: Any) -> None:
        """Record how far the switch got (previous runtime, phase), in place.

        Only a trace for the next command if this one is killed: a note that cannot be written
        (a full file system) never stops a switch half-way; `unwritten` says why it was not."""
        self.info.update(fields)
        data = json.dumps(self.info).encode()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
        except OSError as e:
            self.unwritten = e.strerror or str(e)

    def clear_stale(self) -> None:
        self.stale = None


@contextmanager
def switch_lock(state_dir: Path, target: str) -> Iterator[SwitchLock]:
    """One switch at a time. A second caller is told who holds the lock."""
    with _locked(state_dir, wait=True) as (fd, holder):
        if fd is None:
            raise ApplianceError(
                f"another switch is running: {holder}",
                hint="wait for it to finish; `b70ctl status` shows the result",
                code="switch_in_progress",
                exit_code=3,
            ) from None
        lock = SwitchLock(fd, {}, _stale_info(fd))
        lock.note(
            pid=os.getpid(),
            pid_start=start_time(os.getpid()),
            target=target,
            started_at=time.time(),
            phase="preflight",
        )
        try:
            yield lock
        finally:
            os.ftruncate(fd, 0)


@contextmanager
def killed_switch(state_dir: Path) -> Iterator[SwitchLock | None]:
    """The trace of a switch that was killed, with the lock held while the block runs; None if
    there is none, or if a switch is running now. The trace is removed when the block ends if
    the caller recovered from it (`clear_stale`), and kept for the next command otherwise."""
    with _locked(state_dir, wait=False) as (fd, _):
        stale = _stale_info(fd) if fd is not None else None
        if fd is None or stale is None:
            yield None
            return
        lock = SwitchLock(fd, stale, stale)
        yield lock
        if lock.stale is None:  # recovered: the trace goes
            os.ftruncate(fd, 0)


@contextmanager
def _locked(state_dir: Path, wait: bool) -> Iterator[tuple[int | None, str]]:
    """The switch lock's fd, held exclusively for the block; (None, who holds it) if busy."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for attempt in range(LOCK_TRIES if wait else 1):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # The monitor tests the lock with a brief shared lock, which leaves no details.
                if os.pread(fd, 1, 0) or attempt == LOCK_TRIES - 1 or not wait:
                    yield None, _read_holder(fd)
                    return
                time.sleep(0.05)
        try:
            yield fd, ""
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _stale_info(fd: int) -> dict[str, Any] | None:
    """With the lock held: what the file still says is a switch that ended without cleanup."""
    raw = os.pread(fd, 65536, 0)
    if not raw.strip():
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        info = None
    return info if isinstance(info, dict) else {"target": None, "phase": None}


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        age = time.time() - float(info["started_at"])
        return f"to {info['target']} (pid {info['pid']}, started {age:.0f} s ago)"
    except (ValueError, KeyError, TypeError):
        return "(its details are not written yet)"


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
    import secrets  # only install makes a key: a switch need not import it

    key = "sk-b70-" + secrets.token_urlsafe(32)
    write_atomic(lay.key_file, f"LITELLM_MASTER_KEY={key}\n", mode=0o600)
    return True
