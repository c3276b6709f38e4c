"""The hold mark: while a switch runs, the proxy's hook keeps new requests waiting.

`b70ctl switch` writes the mark into the state directory before it drains the old runtime and
removes it once the new one is verified (or the old one is back). The mark names the switch's
process; a mark whose process is gone (a killed switch) holds nothing. It also carries a token:
the switch's own requests through the proxy (verify, gates) send it and pass the hold.

The proxy's workers count the requests they hold in one small file each, for the monitor.
This module is imported by the proxy, so it stays free of the rest of the controller.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HOLD_FILE = "hold.json"
HELD_DIR = "held"
BYPASS_HEADER = "x-b70-hold-token"


@dataclass(frozen=True)
class Mark:
    pid: int
    target: str
    since: float  # epoch seconds
    token: str


def _write(path: Path, text: str) -> None:
    """Replace a file at once. Not files.write_atomic: no fsync, because the proxy writes its
    counts on its event loop, and the mark and the counts mean nothing after a reboot.

    Readable by all (mkstemp makes 0600): on a system install the proxy runs as its own user and
    reads the mark that root's `b70ctl switch` writes. The mark's token lets a request skip the
    hold, nothing more; the request still needs the API key to get past the proxy at all."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: a pid plus this names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None  # field 22 of proc_pid_stat(5)


class Unwritable(Exception):
    """The mark could not be written (a full file system, a read-only one): nothing is held."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


@contextmanager
def marked(state_dir: Path, target: str) -> Iterator[Mark]:
    """Hold new requests at the proxy for as long as the block runs."""
    state_dir.mkdir(parents=True, exist_ok=True)
    mark = Mark(os.getpid(), target, time.time(), secrets.token_hex(16))
    record = {**mark.__dict__, "pid_start": start_time(mark.pid)}
    path = state_dir / HOLD_FILE
    try:
        _write(path, json.dumps(record) + "\n")
    except OSError as e:
        raise Unwritable(path, e.strerror or str(e)) from None
    try:
        yield mark
    finally:
        path.unlink(missing_ok=True)


def read_mark(state_dir: Path) -> Mark | None:
    """The mark of a switch that is still running, or None."""
    try:
        data = json.loads((state_dir / HOLD_FILE).read_text())
        pid = int(data["pid"])
        mark = Mark(pid, str(data["target"]), float(data["since"]), str(data["token"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    started = start_time(pid)
    if started is None or started != data.get("pid_start"):
        return None  # the switch that wrote it is gone
    return mark


# --- what the proxy's workers hold, for the monitor ---------------------------------------------


@dataclass
class HeldCounts:
    now: int = 0  # requests waiting at this moment
    total: int = 0  # requests that had to wait, ever
    timed_out: int = 0  # of those, answered 503 when the hold time ran out


def write_counts(state_dir: Path, counts: HeldCounts, first: bool = False) -> None:
    """This worker's counts; its first write also removes the files of workers that are gone."""
    folder = state_dir / HELD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    if first:
        for path, _ in _worker_files(folder, alive=False):
            path.unlink(missing_ok=True)
    record = {**counts.__dict__, "pid_start": start_time(os.getpid())}
    _write(folder / f"{os.getpid()}.json", json.dumps(record) + "\n")


def _worker_files(folder: Path, alive: bool) -> Iterator[tuple[Path, dict[str, object]]]:
    try:
        files = list(folder.iterdir())
    except FileNotFoundError:
        return
    for path in files:
        stem = path.name.removesuffix(".json")
        if not (path.name.endswith(".json") and stem.isdigit()):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        is_alive = isinstance(data, dict) and start_time(int(stem)) == data.get("pid_start")
        if is_alive == alive:
            yield path, data


def read_counts(state_dir: Path) -> HeldCounts:
    """The sum over the proxy's live workers (a restarted proxy starts counting anew)."""
    out = HeldCounts()
    for _, data in _worker_files(state_dir / HELD_DIR, alive=True):
        try:
            out.now += int(data["now"])  # type: ignore[call-overload]
            out.total += int(data["total"])  # type: ignore[call-overload]
            out.timed_out += int(data["timed_out"])  # type: ignore[call-overload]
        except (KeyError, ValueError, TypeError):
            continue
    return out
