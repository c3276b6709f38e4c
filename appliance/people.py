"""The people who hold keys to the appliance, with no database: one file in the state directory.

`b70ctl keys add NAME` makes a key for one person and shows its secret once. The file keeps only
the secret's SHA-256, the person's limits and priority, and when the key was made or last
rotated: keys.json, mode 0600 (owned by the proxy's user on a system install, since the proxy
reads it), replaced whole on every change, under an flock so that two `keys` commands at once
never lose one's change.

A secret is 32 random bytes (`secrets.token_urlsafe`), so one unsalted SHA-256 is enough to keep
it: no one can guess such a secret from its hash, and the door hashes a key in about a
microsecond. A slow password hash (scrypt, argon2) protects secrets that people choose, and would
cost every request its time.

The door (appliance.proxy.door) asks `KeyRing.who` for each request: the key is hashed once and
compared, as bytes and in constant time (hmac.compare_digest), with every person's hash and the
master key, with no early exit. The ring looks at the file at most every half second and reads
it when it changed, so the proxy sees a change within a second, without a restart. A file that
cannot be read or makes no sense keeps the last good one, and the journal says so once.

Imported by the proxy: nothing from the rest of the controller but appliance.files and
appliance.hold.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from appliance.files import write_atomic

KEYS_FILE = "keys.json"
KEYS_LOCK = "keys.lock"  # an flock only, beside the file, which is replaced on every change
MASTER = "master"  # the master key's name in usage and metrics; no person may take it
INTERACTIVE, BATCH = "interactive", "batch"
PRIORITIES = (INTERACTIVE, BATCH)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A key longer than this is no key of the appliance's (theirs are 50 bytes): refused unhashed.
MAX_KEY_BYTES = 256
LOOK_EVERY_S = 0.5  # how often the ring looks whether the file changed
SECRET_PREFIX = "sk-b70-"


@dataclass(frozen=True)
class Person:
    """One key: whose, its secret's SHA-256, and the limits the door keeps it to (None: none)."""

    name: str
    digest: bytes
    max_parallel: int | None = None  # requests at once, waiting or running
    rpm: int | None = None  # requests a minute
    tpm: int | None = None  # tokens a minute, in and out
    priority: str = INTERACTIVE
    created: float = 0.0  # epoch seconds
    rotated: float | None = None

    @property
    def limited(self) -> bool:
        return self.max_parallel is not None or self.rpm is not None or self.tpm is not None

    def public(self) -> dict[str, object]:
        """What `keys list` shows: everything but the hash."""
        return {
            "name": self.name, "priority": self.priority, "max_parallel": self.max_parallel,
            "rpm": self.rpm, "tpm": self.tpm, "created": self.created, "rotated": self.rotated,
        }  # fmt: skip


# The master key, as the door names it: no limits, no fair share (the appliance's own checks).
MASTER_KEY = Person(MASTER, b"")


def new_secret() -> str:
    import secrets  # only `keys add` and `keys rotate` make one

    return SECRET_PREFIX + secrets.token_urlsafe(32)


def digest_of(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def name_problem(name: str) -> str | None:
    """What is wrong with a person's name, or None."""
    if name == MASTER:
        return f"{MASTER!r} is the master key's name in usage and metrics; choose another"
    if NAME.fullmatch(name) is None:
        return (
            f"{name!r} is not a key name: 1 to 64 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit"
        )
    return None


# --- the file ------------------------------------------------------------------------------------


def parse_keys(text: str) -> dict[str, Person]:
    """The people of a keys file's text; ValueError saying what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"it is not JSON ({e})") from None
    if (
        not isinstance(data, dict)
        or data.get("version") != 1
        or not isinstance(data.get("keys"), dict)
    ):
        raise ValueError('it is not a keys file of the appliance ({"version": 1, "keys": {...}})')
    out: dict[str, Person] = {}
    for name, entry in data["keys"].items():
        if name_problem(name) is not None or not isinstance(entry, dict):
            raise ValueError(f"its key {name!r} is not one `b70ctl keys` wrote")
        try:
            digest = bytes.fromhex(entry["sha256"])
            limits = [entry.get(k) for k in ("max_parallel", "rpm", "tpm")]
            priority, created = entry.get("priority", INTERACTIVE), float(entry["created"])
            rotated = entry.get("rotated")
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"its key {name!r} is not one `b70ctl keys` wrote") from None
        bad_limit = any(not _count(v) for v in limits if v is not None)
        if len(digest) != 32 or bad_limit or priority not in PRIORITIES:
            raise ValueError(f"its key {name!r} is not one `b70ctl keys` wrote")
        max_parallel, rpm, tpm = limits
        out[name] = Person(
            name, digest, max_parallel, rpm, tpm, priority, created,
            float(rotated) if isinstance(rotated, int | float) else None,
        )  # fmt: skip
    return out


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def dump_keys(people: Mapping[str, Person]) -> str:
    keys = {
        p.name: {"sha256": p.digest.hex(), **{k: v for k, v in p.public().items() if k != "name"}}
        for p in sorted(people.values(), key=lambda p: p.name)
    }
    return json.dumps({"version": 1, "keys": keys}, indent=2) + "\n"


class KeysUnreadable(Exception):
    """The keys file exists and cannot be read, or is not one `b70ctl keys` wrote."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def read_keys(state_dir: Path) -> dict[str, Person]:
    """The people of the keys file ({} when there is none); KeysUnreadable otherwise."""
    path = state_dir / KEYS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise KeysUnreadable(path, getattr(e, "strerror", None) or str(e)) from None
    try:
        return parse_keys(text)
    except ValueError as e:
        raise KeysUnreadable(path, str(e)) from None


@contextmanager
def editing(state_dir: Path, owner: int | None = None) -> Iterator[dict[str, Person]]:
    """The people, to change in the block; written back whole, atomically and synced, when the
    block ends without an error. One `keys` command at a time (an flock): none loses another's
    change. `owner`: the uid the file belongs to (the proxy's user on a system install)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / KEYS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        people = read_keys(state_dir)
        before = dict(people)
        yield people
        if people != before:
            write_atomic(state_dir / KEYS_FILE, dump_keys(people), mode=0o600, owner=owner)
    finally:
        os.close(fd)  # and the flock with it


def added(people: dict[str, Person], name: str, secret: str, **limits: object) -> Person:
    person = Person(name, digest_of(secret), created=time.time(), **limits)  # type: ignore[arg-type]
    people[name] = person
    return person


def rotated(people: dict[str, Person], name: str, secret: str) -> Person:
    person = replace(people[name], digest=digest_of(secret), rotated=time.time())
    people[name] = person
    return person


# --- who sent a request --------------------------------------------------------------------------


def identify(given: str, master: str, people: Mapping[str, Person]) -> Person | None:
    """Whose key `given` is: MASTER_KEY, a person, or None. Compared as bytes in constant time
    against every key, with no early exit; a key that is too long or not ASCII is no one's, and
    is not hashed (a quick refusal, whatever its size)."""
    if not given or len(given) > MAX_KEY_BYTES or not given.isascii():
        return None
    raw = given.encode("ascii")
    found = MASTER_KEY if master and hmac.compare_digest(raw, master.encode("utf-8")) else None
    digest = hashlib.sha256(raw).digest()
    for person in people.values():
        if hmac.compare_digest(digest, person.digest):
            found = person
    return found


def _journal(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class KeyRing:
    """The keys the door takes: the master key (read each time) and the people of the keys file
    (`path`; None: the master key alone), looked at every LOOK_EVERY_S and read when changed."""

    def __init__(
        self,
        path: Path | None,
        master: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = _journal,
    ) -> None:
        self.path = path
        self.master = master
        self.clock = clock
        self.log = log
        self.people: dict[str, Person] = {}
        self.seen: tuple[int, ...] | None = None  # the file read last: inode, times, size
        self.looked = -math.inf
        self.problem: str | None = None  # why the file could not be read, said once

    def who(self, given: str) -> Person | None:
        return identify(given, self.master(), self.current())

    def current(self) -> Mapping[str, Person]:
        now = self.clock()
        if self.path is not None and now - self.looked >= LOOK_EVERY_S:
            self.looked = now
            self.refresh(self.path)
        return self.people

    def refresh(self, path: Path) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self.people, self.seen, self.problem = {}, None, None  # no keys file: no people
            return
        except OSError as e:
            self.unreadable(path, e.strerror or str(e))
            return
        seen = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)  # ctime: a chmod too
        if seen == self.seen:
            return
        self.seen = seen
        try:
            self.people = parse_keys(path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            self.unreadable(path, getattr(e, "strerror", None) or str(e))
            return
        except ValueError as e:
            self.unreadable(path, str(e))
            return
        self.problem = None

    def unreadable(self, path: Path, why: str) -> None:
        if why != self.problem:
            self.problem = why
            self.log(
                f"b70: the keys file {path} cannot be read ({why}); the last good one stands "
                f"({len(self.people)} keys) until `b70ctl keys` writes it anew"
            )
