"""The hold mark: while a switch runs, the proxy's hook keeps new requests waiting.

`b70ctl switch` writes the mark into the state directory before it drains the old runtime and
removes it once the new one is verified (or the old one is back). The mark names the switch's
process; a mark whose process is gone (a killed switch) holds nothing. It also carries a token:
the switch's own requests through the proxy (verify, gates) send it and pass the hold.

The proxy's workers count the requests they hold in one small file per worker and runtime port,
with since when the oldest waits: the monitor's figures, and the queues that the switch on
demand reads (`read_queues`). The requests they let through and have not answered go in a
shared one, for the switch's drain. The switch on demand writes back which runtimes failed to
start (`read_refused`): their requests get a 503 at once. This module is imported by the proxy,
so it stays free of the rest of the controller.
"""

from __future__ import annotations

import contextvars
import fcntl
import json
import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HOLD_FILE = "hold.json"
HELD_DIR = "held"
BYPASS_HEADER = "x-b70-hold-token"
# On a request a peer appliance's front door sends: this box answers it from its own runtimes,
# and at once (appliance.proxy.routing)
PEER_HEADER = "x-b70-peer"


@dataclass(frozen=True)
class Mark:
    """A switch's hold: who holds, for which runtime and ports, and its token."""

    pid: int
    target: str
    since: float  # epoch seconds
    token: str
    # The runtime ports whose requests wait: the target's and those of the runtimes it stops.
    # Runtimes serving on other cards go on answering. None: every port (a mark without them).
    ports: tuple[int, ...] | None = None
    # Why the mark's file could not be read, if it could not: such a mark holds every request
    # (its token matches none) and says so, rather than count as no switch.
    problem: str | None = None

    def holds(self, port: int | None) -> bool:
        return self.ports is None or port is None or port in self.ports


def create_beside(path: Path) -> tuple[int, str]:
    """A new file in `path`'s directory that no one else opened (O_EXCL), mode 0600, to be
    renamed over `path`: what tempfile.mkstemp makes, without importing tempfile (and shutil
    and random with it) at every switch's start (docs/startup.md)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    while True:
        tmp = str(path.parent / f".{path.name}.{os.urandom(6).hex()}")
        try:
            return os.open(tmp, flags, 0o600), tmp
        except FileExistsError:  # 48 random bits met another: draw again
            continue


def write_shared(path: Path, text: str) -> None:
    """Replace a file at once. Not files.write_atomic: no fsync, because the proxy writes its
    counts on its event loop, and the mark and the counts mean nothing after a reboot.

    Readable by all (create_beside makes 0600): on a system install the proxy runs as its own
    user and reads the mark that root's `b70ctl switch` writes. The mark's token lets a request
    skip the hold, nothing more; the request still needs the API key to get past the proxy."""
    fd, tmp = create_beside(path)
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
def marked(state_dir: Path, target: str, ports: tuple[int, ...] | None = None) -> Iterator[Mark]:
    """Hold new requests to `ports` (every port: None) at the proxy while the block runs."""
    state_dir.mkdir(parents=True, exist_ok=True)
    mark = Mark(os.getpid(), target, time.time(), os.urandom(16).hex(), ports)
    record = {**mark.__dict__, "pid_start": start_time(mark.pid)}
    path = state_dir / HOLD_FILE
    try:
        write_shared(path, json.dumps(record) + "\n")
    except OSError as e:
        raise Unwritable(path, e.strerror or str(e)) from None
    try:
        yield mark
    finally:
        path.unlink(missing_ok=True)


def read_mark(state_dir: Path) -> Mark | None:
    """The mark of a switch that is still running; None if there is none. A mark that exists
    and cannot be read is a Mark with its `problem`: it holds, and is never taken for none."""
    path = state_dir / HOLD_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        return _unreadable(path, e.strerror or str(e))
    try:
        data = json.loads(text)
        pid = int(data["pid"])
        ports = data.get("ports")
        mark = Mark(
            pid, str(data["target"]), float(data["since"]), str(data["token"]),
            None if ports is None else tuple(int(p) for p in ports),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError):
        return _unreadable(path, "it is not a hold mark the appliance wrote")
    started = start_time(pid)
    if started is None or started != data.get("pid_start"):
        return None  # the switch that wrote it is gone
    return mark


def _unreadable(path: Path, why: str) -> Mark:
    problem = f"{path}: {why}; the next `b70ctl switch` writes it anew"
    return Mark(0, "?", time.time(), "", None, problem)


# --- what the proxy's workers hold, for the monitor ---------------------------------------------


@dataclass
class HeldCounts:
    """Requests held at the proxy: now, in all, and those that timed out."""

    now: int = 0  # requests waiting at this moment
    total: int = 0  # requests that had to wait, ever
    timed_out: int = 0  # of those, answered 503 when the hold time ran out


def write_counts(
    state_dir: Path,
    counts: HeldCounts,
    first: bool = False,
    port: int | None = None,
    oldest: float | None = None,
    tokens: int = 0,
) -> None:
    """One turnstile's counts, in a file of its worker and runtime port (PID-PORT.json; PID.json
    without a port); its first write also removes the files of workers that are gone. `oldest`:
    since when (epoch seconds) the longest-waiting of the `counts.now` requests waits; `tokens`:
    the most tokens of an answer they ask for, together."""
    folder = state_dir / HELD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    if first:
        for path, _ in _worker_files(folder, alive=False):
            path.unlink(missing_ok=True)
    record = {**counts.__dict__, "pid_start": start_time(os.getpid())}
    if port is not None:
        record |= {"port": port, "oldest": oldest, "tokens": tokens}
    name = f"{os.getpid()}.json" if port is None else f"{os.getpid()}-{port}.json"
    write_shared(folder / name, json.dumps(record) + "\n")


def _worker_files(folder: Path, alive: bool) -> Iterator[tuple[Path, dict[str, object]]]:
    try:
        files = list(folder.iterdir())
    except FileNotFoundError:
        return
    for path in files:
        pid, _, port = path.name.removesuffix(".json").partition("-")
        if not (path.name.endswith(".json") and pid.isdigit() and (port == "" or port.isdigit())):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        is_alive = isinstance(data, dict) and start_time(int(pid)) == data.get("pid_start")
        if is_alive == alive:
            yield path, data


@dataclass(frozen=True)
class Queue:
    """The requests waiting at the proxy for one runtime port, over its live workers."""

    count: int
    oldest: float  # since when (epoch seconds) the longest-waiting one waits
    tokens: int = 0  # the most tokens of an answer they ask for, together (as far as they say)


def read_queues(state_dir: Path) -> dict[int, Queue]:
    """Runtime port -> the requests waiting for it now (ports with none are left out)."""
    out: dict[int, Queue] = {}
    for _, data in _worker_files(state_dir / HELD_DIR, alive=True):
        port, now, oldest = data.get("port"), data.get("now"), data.get("oldest")
        if not (isinstance(port, int) and isinstance(now, int) and now > 0):
            continue
        since = float(oldest) if isinstance(oldest, int | float) else time.time()
        tokens = data.get("tokens")
        tokens = tokens if isinstance(tokens, int) and tokens > 0 else 0
        before = out.get(port)
        if before is not None:
            now, since = now + before.count, min(since, before.oldest)
            tokens += before.tokens
        out[port] = Queue(now, since, tokens)
    return out


# --- what the monitor's switch on demand says to the requests it cannot serve -------------------

DEMAND_FILE = "demand.json"


@dataclass(frozen=True)
class Refused:
    """A runtime that failed to start on demand: requests waiting for its port get a 503 at
    once until `until`, rather than a switch tried again for each."""

    runtime: str
    until: float  # epoch seconds
    why: str


def write_demand(state_dir: Path, doc: dict[str, object]) -> None:
    """The switch on demand's record ({"refused": {PORT: {runtime, until, why}}, ...}): written by
    the monitor, read by the proxy's workers (so readable by all, like the mark)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    write_shared(state_dir / DEMAND_FILE, json.dumps(doc, sort_keys=True) + "\n")


def read_demand(state_dir: Path) -> dict[str, object]:
    try:
        data = json.loads((state_dir / DEMAND_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_refused(state_dir: Path, port: int | None, now: float | None = None) -> Refused | None:
    """Whether requests for `port` are refused now, because its runtime failed to start."""
    refused = read_demand(state_dir).get("refused")
    entry = refused.get(str(port)) if isinstance(refused, dict) else None
    if not isinstance(entry, dict):
        return None
    try:
        out = Refused(str(entry["runtime"]), float(entry["until"]), str(entry["why"]))
    except (KeyError, TypeError, ValueError):
        return None
    return out if out.until > (time.time() if now is None else now) else None


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


# --- what the proxy's workers let through and have not answered yet, for the drain --------------

OPEN_FILE = "open"  # in HELD_DIR: one slot per worker, (pid, requests open), native int64s;
# one file per runtime port, open-PORT (`open` where the proxy knows no port)
SLOT = struct.Struct("=qq")
SLOTS = 256
_LOCK = struct.Struct("@hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid


def _slot_lock(fd: int, command: int, kind: int, slot: int) -> int:
    """An open-file-description lock (fcntl(2), F_OFD_*) on one slot; the lock's type after
    the call (F_OFD_GETLK: F_UNLCK when nobody holds the slot)."""
    request = _LOCK.pack(kind, os.SEEK_SET, slot * SLOT.size, SLOT.size, 0)
    return int(_LOCK.unpack(fcntl.fcntl(fd, command, request))[0])


class OpenRequests:
    """This worker's count of the requests it let past the hold that have not been answered.

    The count lives in one slot of a small file shared by the proxy's workers, mapped into
    memory, so counting costs no system call. A worker owns its slot by holding a lock on it;
    the kernel lets go of the lock when the worker dies, so the drain (`read_open`) counts only
    the slots of live workers. Open-file-description locks, not process-wide ones: nothing else
    in the worker that opens and closes the file can drop them, and a forked worker does not
    share its parent's slot."""

    def __init__(self, state_dir: Path, port: int | None = None) -> None:
        self.path = state_dir / HELD_DIR / open_file(port)
        self.pid: int | None = None
        self.map: mmap.mmap | None = None
        self.offset = 0
        self.value = 0

    def add(self, n: int) -> None:
        if self.pid != os.getpid():
            self.map, self.pid, self.value = self._attach(), os.getpid(), 0
        if self.map is None:
            return  # the file cannot be shared: the drain falls back to the runtime's metrics
        self.value = max(0, self.value + n)
        SLOT.pack_into(self.map, self.offset, self.pid, self.value)

    def _attach(self) -> mmap.mmap | None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return None
        try:
            os.fchmod(fd, 0o644)
            if os.fstat(fd).st_size < SLOTS * SLOT.size:
                os.ftruncate(fd, SLOTS * SLOT.size)
            for slot in range(SLOTS):
                try:
                    _slot_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, slot)
                except OSError:
                    continue  # another worker's
                shared = mmap.mmap(fd, SLOTS * SLOT.size)
                self.offset = slot * SLOT.size
                SLOT.pack_into(shared, self.offset, os.getpid(), 0)
                return shared  # the fd stays open, and with it the lock, for the worker's life
        except OSError:
            pass
        os.close(fd)
        return None


def open_file(port: int | None) -> str:
    return OPEN_FILE if port is None else f"{OPEN_FILE}-{port}"


class Ticket:
    """One request's place in its worker's open count: open while it is let through to the
    runtime, closed while it waits at the hold and when its answer has ended. `model`: the
    name it asked for, which says whose hold and count it is (appliance.proxy.hook)."""

    def __init__(
        self, model: str | None = None, token: str | None = None, from_peer: bool = False
    ) -> None:
        self.model = model
        self.token = token  # its hold token: a switch's own request
        self.from_peer = from_peer  # a peer's front door sent it: this box's runtimes answer it
        self.tokens = 0  # the most tokens of an answer it asks for, if it says
        self.queued_s = 0.0  # how long it waited at the hold, in all
        self.counted: OpenRequests | None = None

    def open(self, counts: OpenRequests) -> None:
        if self.counted is None:
            counts.add(+1)
            self.counted = counts

    def close(self) -> None:
        if self.counted is not None:
            self.counted.add(-1)
            self.counted = None


# The request being answered, set by the door for the turnstiles (same task, same context).
TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("b70_ticket", default=None)


def read_open(state_dir: Path, port: int | None = None) -> int | None:
    """Requests to the runtime on `port` that the proxy's live workers let past the hold and
    have not answered; None when the proxy does not count them (no file yet, or unreadable)."""
    try:
        fd = os.open(state_dir / HELD_DIR / open_file(port), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.pread(fd, SLOTS * SLOT.size, 0)
        total = 0
        for slot in range(len(data) // SLOT.size):
            pid, value = SLOT.unpack_from(data, slot * SLOT.size)
            if pid and value > 0:
                held = _slot_lock(fd, fcntl.F_OFD_GETLK, fcntl.F_RDLCK, slot)
                if held != fcntl.F_UNLCK:
                    total += value
        return total
    except OSError:
        return None
    finally:
        os.close(fd)
