"""`b70ctl uninstall --purge` in the state directory: remove what the appliance made there, and
nothing else. A file a person put there (a model, a note) stays, and so does its folder."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from appliance import hold, keyorder, keys, layout, people, usage
from appliance.switch.demand.pins import PIN_FILE

# The state directory's files, each made by the appliance (appliance.layout, appliance.hold).
STATE_FILES = frozenset(
    {
        layout.LOCK_FILE,
        layout.NOTE_FILE,
        layout.KILLED_FILE,
        layout.LAST_SWITCH,
        layout.HISTORY,
        layout.MONITOR_RECORD,
        layout.SAMPLES,
        layout.CANARY_FILE,
        layout.RENDERED,
        hold.HOLD_FILE,
        hold.DEMAND_FILE,
        PIN_FILE,
        people.KEYS_FILE,
        people.KEYS_LOCK,
        keys.TLS_CERT_FILE,  # the self-signed certificate install made, and its key
        keys.TLS_KEY_FILE,
    }
)
# In the proxy's folder of held requests: a file per worker and runtime port (PID.json,
# PID-PORT.json), the open counts, and each runtime port's fair turns (turns-PORT.db, its
# write-ahead log and shared memory, turns-PORT.lock, and the JSON of releases before them:
# appliance.proxy.share.turns), and the keys learned from the fleet's other front doors.
HELD_FILE = re.compile(
    rf"(\d+(-\d+)?\.json|{hold.OPEN_FILE}(-\d+)?|turns-\d+\.(json|db|db-wal|db-shm|lock)"
    rf"|{re.escape(keyorder.FLEET_FILE)})"
)
# ... and its folders: each worker's usage per key (appliance.usage), each limited key's counts
# (appliance.proxy.share.limits, whose folder name is the proxy's own: "keys").
HELD_FOLDERS = {
    usage.USAGE_DIR: re.compile(r"\d+\.jsonl"),
    "keys": re.compile(rf"{people.NAME.pattern}\.(json|lock)"),
}
# A file being replaced when its writer died: `.NAME.` and 12 hex digits (hold.create_beside).
TEMPORARY = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{12}")


@dataclass
class Purged:
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # files the appliance did not make
    failed: list[str] = field(default_factory=list)  # the appliance's, which could not go


def ours(name: str, pattern: re.Pattern[str] | frozenset[str]) -> bool:
    """Whether a file of this name is one the appliance makes (or a temporary one of those)."""
    match = TEMPORARY.fullmatch(name)
    base = match.group("name") if match else name
    if isinstance(pattern, frozenset):
        return base in pattern
    return pattern.fullmatch(base) is not None


def purge_state(state_dir: Path) -> Purged:
    """Remove the appliance's files from `state_dir` (and its held/ folder), then each folder
    if nothing else is left in it. Never follows a link or enters a folder of someone else's."""
    out = Purged()
    if not state_dir.is_dir() or state_dir.is_symlink():
        return out
    held = state_dir / hold.HELD_DIR
    if held.is_dir() and not held.is_symlink():
        for name, pattern in HELD_FOLDERS.items():
            inner = held / name
            if inner.is_dir() and not inner.is_symlink():
                _remove(inner, pattern, out)
                _remove_folder(inner, out)
        _remove(held, HELD_FILE, out)
        _remove_folder(held, out)
    _remove(state_dir, STATE_FILES, out)
    _remove_folder(state_dir, out)
    return out


def _remove(folder: Path, pattern: re.Pattern[str] | frozenset[str], out: Purged) -> None:
    for path in sorted(folder.iterdir()):
        if path.is_dir() and not path.is_symlink():
            continue  # a folder: held/ is handled on its own, any other is someone's
        if not ours(path.name, pattern):
            out.kept.append(str(path))
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            out.failed.append(f"{path}: {e.strerror or e}")
            continue
        out.removed.append(str(path))


def _remove_folder(folder: Path, out: Purged) -> None:
    if any(folder.iterdir()):
        others = [p for p in sorted(folder.iterdir()) if p.is_dir() and p.name != hold.HELD_DIR]
        out.kept.extend(str(p) for p in others)
        return
    try:
        folder.rmdir()
    except OSError as e:
        out.failed.append(f"{folder}: {e.strerror or e}")
        return
    out.removed.append(str(folder))
