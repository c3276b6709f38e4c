"""Who used what: each key's requests, tokens in and out, time queued and refusals (429), with no
database.

Each proxy worker keeps its counts in memory and appends what changed, at most every FLUSH_S
seconds, as one JSON line to a file of its own in the state directory (held/usage/PID.jsonl):

    {"t": 1764676800.5, "keys": {"alice": {"requests": 3, "in": 120, "out": 300,
                                           "queued_s": 0.4, "limited": 1}}}

A line is what happened since the worker's line before, so the usage since any moment is the sum
of the lines written after it (`read_usage`), and the whole is a counter that only grows
(`Totals`, which reads only the new lines of each file on each call: the monitor's metrics).
Files whose worker is gone are kept for RETAIN_S after their last line, then removed by the next
worker that starts. Keys are named, never their secrets.

Imported by the proxy: nothing from the rest of the controller but appliance.hold.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from appliance.hold import HELD_DIR

USAGE_DIR = "usage"  # in HELD_DIR: what the proxy's workers write
FLUSH_S = 2.0
RETAIN_S = 31 * 86400.0


@dataclass
class Use:
    """One key's use over some time."""

    requests: int = 0  # answered: by the runtime, or with an error the door or runtime gave
    tokens_in: int = 0  # as the runtime's answers counted them
    tokens_out: int = 0
    queued_s: float = 0.0  # waiting at the door: a switch's hold, the fair queue
    limited: int = 0  # refused with 429 by the key's limits

    def add(self, other: Use) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_line(self) -> dict[str, float]:
        return {"requests": self.requests, "in": self.tokens_in, "out": self.tokens_out,
                "queued_s": round(self.queued_s, 3), "limited": self.limited}  # fmt: skip

    @staticmethod
    def of_line(data: Mapping[str, object]) -> Use | None:
        out = Use()
        for name, word in (("requests", "requests"), ("tokens_in", "in"), ("tokens_out", "out"),
                           ("limited", "limited")):  # fmt: skip
            value = data.get(word, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return None
            setattr(out, name, value)
        queued = data.get("queued_s", 0)
        if not isinstance(queued, int | float) or isinstance(queued, bool) or queued < 0:
            return None
        out.queued_s = float(queued)
        return out


# Front doors that share a Redis ([peers] redis_host) add each key's use there too, by the hour:
# hash FLEET_USAGE + the hour's start (epoch seconds), field "NAME<tab>WORD" (WORD of as_line),
# kept as long as the files are. A request a peer sent is counted by the door that took it.
FLEET_USAGE = "b70:usage:"
HOUR_S = 3600


def fleet_usage(hours: Mapping[int, Mapping[str, str]]) -> dict[str, Use]:
    """Each key's use from the fleet's hourly hashes (hour -> field -> number)."""
    out: dict[str, Use] = {}
    for counts in hours.values():
        per_name: dict[str, dict[str, float]] = {}
        for where, number in counts.items():
            name, _, word = where.partition("\t")
            try:
                per_name.setdefault(name, {})[word] = float(number)
            except ValueError:
                continue
        for name, words in per_name.items():
            ints = {w: int(v) for w, v in words.items() if w != "queued_s"}
            use = Use.of_line({**ints, "queued_s": words.get("queued_s", 0.0)})
            if use is not None:
                out.setdefault(name, Use()).add(use)
    return out


def usage_dir(state_dir: Path) -> Path:
    return state_dir / HELD_DIR / USAGE_DIR


# --- the proxy's side -----------------------------------------------------------------------------


@dataclass
class Ledger:
    """A worker's counts since its last line, written as one line when FLUSH_S has passed (or
    soon after: `later` schedules the write, on the worker's event loop)."""

    state_dir: Path
    clock: Callable[[], float] = time.monotonic
    later: Callable[[float, Callable[[], None]], object] | None = None
    log: Callable[[str], None] = lambda line: None
    pending: dict[str, Use] = field(default_factory=dict)
    written: float = -FLUSH_S
    scheduled: bool = False
    pid: int | None = None
    said: str | None = None

    def add(self, name: str, use: Use) -> None:
        self.pending.setdefault(name, Use()).add(use)
        if self.clock() - self.written >= FLUSH_S:
            self.flush()
        elif not self.scheduled and self.later is not None:
            self.scheduled = True
            self.later(FLUSH_S, self.flush)

    def flush(self) -> None:
        self.scheduled = False
        if not self.pending:
            return
        self.written = self.clock()
        line = {
            "t": round(time.time(), 3),
            "keys": {n: u.as_line() for n, u in self.pending.items()},
        }
        try:
            folder = usage_dir(self.state_dir)
            if self.pid != os.getpid():  # this worker's first line: the old files go now
                folder.mkdir(parents=True, exist_ok=True)
                os.chmod(folder, 0o755)  # the proxy's umask is 0077; `b70ctl usage` is anyone's
                prune(folder)
                self.pid = os.getpid()
            fd = os.open(folder / f"{self.pid}.jsonl",
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)  # fmt: skip
            try:
                os.fchmod(fd, 0o644)  # names and counts: `b70ctl usage` reads it, as any user
                os.write(fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
            finally:
                os.close(fd)
        except OSError as e:
            problem = f"b70: cannot write the usage per key in {self.state_dir}: {e.strerror or e}"
            if problem != self.said:  # said once while it stays the same
                self.said = problem
                self.log(problem + "; `b70ctl usage` and the metrics miss it")
            return
        self.pending.clear()


def prune(folder: Path, now: float | None = None) -> None:
    """Remove the usage files whose last line is older than RETAIN_S."""
    limit = (time.time() if now is None else now) - RETAIN_S
    for path in folder.glob("*.jsonl"):
        try:
            if path.stat().st_mtime < limit:
                path.unlink()
        except OSError:
            continue


# --- the readers' side ----------------------------------------------------------------------------


def _lines(text: str) -> Iterator[tuple[float, dict[str, Use]]]:
    for raw in text.splitlines():
        try:
            data = json.loads(raw)
            t, keys = float(data["t"]), data["keys"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a full disk, or not the appliance's
        if not isinstance(keys, dict):
            continue
        uses = {str(n): u for n, v in keys.items() if isinstance(v, dict) and (u := Use.of_line(v))}
        yield t, uses


def read_usage(state_dir: Path, since: float | None = None) -> dict[str, Use]:
    """Each key's use since `since` (epoch seconds; None: all that is kept)."""
    out: dict[str, Use] = {}
    for path in sorted(usage_dir(state_dir).glob("*.jsonl")):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        for t, uses in _lines(text):
            if since is not None and t < since:
                continue
            for name, use in uses.items():
                out.setdefault(name, Use()).add(use)
    return out


class Totals:
    """Each key's use ever (as far as the files keep), read anew on each call from where the last
    call stopped in each file: a counter for the metrics that costs only the new lines."""

    def __init__(self, state_dir: Path) -> None:
        self.folder = usage_dir(state_dir)
        self.read: dict[Path, int] = {}  # bytes of each file already counted
        self.totals: dict[str, Use] = {}

    def __call__(self) -> dict[str, Use]:
        for path in sorted(self.folder.glob("*.jsonl")):
            done = self.read.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(done)
                    chunk = f.read()
            except OSError:
                continue
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for its end
            self.read[path] = done + len(whole)
            for _, uses in _lines(whole.decode("utf-8", "replace")):
                for name, use in uses.items():
                    self.totals.setdefault(name, Use()).add(use)
        return self.totals
