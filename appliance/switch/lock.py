"""The switch lock: one writer at a time (a switch, install, uninstall), its note of who holds it,
and the note a killed switch left for the next writer to recover."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.files import write_atomic
from appliance.hold import read_mark, start_time
from appliance.layout import KILLED_FILE, LOCK_FILE, NOTE_FILE

LOCK_TRIES = 20


class SwitchLock:
    """The held lock of a running switch, and its note: who holds it and how far it got, so a
    switch that is killed (SIGKILL: no cleanup runs) leaves a trace the next writer finds.

    The lock is an flock on switch.lock, which holds nothing; the note is switch.json, replaced
    whole at each phase. A note found when the lock is taken is a killed switch's: it is moved
    to killed-switch.json, where it stays until a recovery has recorded it (`clear_stale`).
    """

    def __init__(self, state_dir: Path, info: dict[str, Any], stale: dict[str, Any] | None) -> None:
        self.state_dir = state_dir
        self.info = info
        # What a killed switch left before this one took the lock, if anything.
        self.stale = stale
        self.unwritten: str | None = None

    def note(self, **fields: Any) -> None:
        """Record how far the switch got (previous runtime, phase), atomically.

        Only a trace for the next command if this one is killed: a note that cannot be written
        (a full file system) never stops a switch half-way; `unwritten` says why it was not."""
        self.info.update(fields)
        try:
            write_atomic(self.state_dir / NOTE_FILE, json.dumps(self.info) + "\n")
        except OSError as e:
            self.unwritten = e.strerror or str(e)

    def clear_stale(self) -> None:
        """The killed switch was recovered and recorded: its trace goes."""
        self.stale = None
        (self.state_dir / KILLED_FILE).unlink(missing_ok=True)


@contextmanager
def switch_lock(state_dir: Path, target: str) -> Iterator[SwitchLock]:
    """One switch at a time. A second caller is told who holds the lock."""
    with _locked(state_dir, wait=True) as held:
        if not held:
            raise ApplianceError(
                _read_holder(state_dir),
                hint="wait for it to finish; `b70ctl status` shows the result",
                code="switch_in_progress",
                exit_code=3,
            ) from None
        lock = SwitchLock(state_dir, {}, _take_stale(state_dir))
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
            (state_dir / NOTE_FILE).unlink(missing_ok=True)


@contextmanager
def killed_switch(state_dir: Path) -> Iterator[SwitchLock | None]:
    """The trace of a switch that was killed, with the lock held while the block runs; None if
    there is none, or if a switch is running now. The trace is removed when the caller has
    recovered from it (`clear_stale`), and kept for the next command otherwise."""
    with _locked(state_dir, wait=False) as held:
        stale = _take_stale(state_dir) if held else None
        yield None if stale is None else SwitchLock(state_dir, stale, stale)


@contextmanager
def writer_lock(state_dir: Path, command: str) -> Iterator[SwitchLock]:
    """The switch lock for install and uninstall: nothing else changes the units meanwhile. Its
    note names the command; a killed install leaves nothing to recover (its note is dropped)."""
    with _locked(state_dir, wait=True) as held:
        if not held:
            raise ApplianceError(
                _read_holder(state_dir),
                hint=f"wait for it to finish, then run `b70ctl {command}` again",
                code="switch_in_progress",
                exit_code=3,
            )
        lock = SwitchLock(state_dir, {}, _take_stale(state_dir))
        lock.note(
            command=command,
            pid=os.getpid(),
            pid_start=start_time(os.getpid()),
            started_at=time.time(),
        )
        try:
            yield lock
        finally:
            (state_dir / NOTE_FILE).unlink(missing_ok=True)


def try_lock(state_dir: Path) -> AbstractContextManager[bool]:
    """The switch lock for a short act of another writer (the monitor's restart): True while it
    is held; False at once if a switch holds it."""
    return _locked(state_dir, wait=False)


def switch_running(state_dir: Path) -> bool:
    """Whether a switch holds the lock (preflight) or the hold mark (drain, start, verify); the
    lock is tested with a brief shared lock, which a switch that starts meanwhile waits out."""
    return read_mark(state_dir) is not None or _lock_held(state_dir)


def _lock_held(state_dir: Path) -> bool:
    try:
        fd = os.open(state_dir / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def waiting_trace(state_dir: Path) -> dict[str, Any] | None:
    """A killed switch that waits to be recovered, read without writing anything (what `status`
    reports, for any user): the moved trace, or a note whose switch is no longer running."""
    for name in (KILLED_FILE, NOTE_FILE):
        info = _read_note(state_dir / name)
        if info is None or info.get("command", "switch") != "switch":
            continue
        if name == KILLED_FILE or not _alive(info):
            return info
    return None


def _alive(info: dict[str, Any]) -> bool:
    pid, began = info.get("pid"), info.get("pid_start")
    return isinstance(pid, int) and pid > 0 and began is not None and start_time(pid) == began


def _take_stale(state_dir: Path) -> dict[str, Any] | None:
    """With the lock held: a note left behind is a killed switch's. It moves aside (unless an
    older one waits there already) and the trace waiting for recovery is returned."""
    note, killed = state_dir / NOTE_FILE, state_dir / KILLED_FILE
    if note.exists():
        left = _read_note(note) or {}
        if killed.exists() or left.get("command", "switch") != "switch":
            # Recovering the older one settles the appliance for both; a killed install or
            # uninstall leaves no switch to recover.
            note.unlink()
        else:
            os.replace(note, killed)
    if not killed.exists():
        return None
    return _read_note(killed) or {"target": None, "phase": None}


def _read_note(path: Path) -> dict[str, Any] | None:
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"target": None, "phase": None}
    return info if isinstance(info, dict) else {"target": None, "phase": None}


@contextmanager
def _locked(state_dir: Path, wait: bool) -> Iterator[bool]:
    """The switch lock, held exclusively for the block (True); False if another holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for attempt in range(LOCK_TRIES if wait else 1):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # The monitor tests the lock with a brief shared lock, which writes no note.
                if (state_dir / NOTE_FILE).exists() or attempt == LOCK_TRIES - 1 or not wait:
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read_holder(state_dir: Path) -> str:
    """Who holds the switch lock, for the one who could not take it."""
    info = _read_note(state_dir / NOTE_FILE) or {}
    command = info.get("command", "switch")
    try:
        age = time.time() - float(info["started_at"])
        pid = f"pid {info['pid']}, started {age:.0f} s ago"
        if command == "switch":
            return f"another switch is running: to {info['target']} ({pid})"
        return f"b70ctl {command} is running ({pid})"
    except (ValueError, KeyError, TypeError):
        return "another switch is running (its details are not written yet)"
