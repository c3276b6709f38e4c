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
from typing import Any

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
class Revoked:
    """A key revoked on this door: when, by its clock, and over which change of the fleet's."""

    at: float
    base: int = 0


@dataclass(frozen=True)
class Person:
    """One key: whose, its secret's SHA-256, and the limits the door keeps it to (None: none)."""

    name: str
    digest: bytes
    max_parallel: int | None = None  # requests at once, waiting or running
    rpm: int | None = None  # requests a minute
    tpm: int | None = None  # tokens a minute, in and out
    priority: str = INTERACTIVE
    created: float = 0.0  # epoch seconds, by the clock of the door that made it
    rotated: float | None = None
    base: int = 0  # in a fleet: the order number of the change it was made over (keyorder)

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


def _data(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"it is not JSON ({e})") from None
    if (
        not isinstance(data, dict)
        or data.get("version") != 1
        or not isinstance(data.get("keys"), dict)
        or not isinstance(data.get("revoked", {}), dict)
    ):
        raise ValueError('it is not a keys file of the appliance ({"version": 1, "keys": {...}})')
    return data


def parse_keys(text: str) -> dict[str, Person]:
    """The people of a keys file's text; ValueError saying what is wrong."""
    out: dict[str, Person] = {}
    for name, entry in _data(text)["keys"].items():
        person = person_of(name, entry)
        if person is None:
            raise ValueError(f"its key {name!r} is not one `b70ctl keys` wrote")
        out[name] = person
    return out


def parse_revoked(text: str) -> dict[str, Revoked]:
    """The keys revoked here, each as when and over what (what peers learn through Redis); an
    entry that is a bare time is one an earlier version wrote, over nothing."""
    out: dict[str, Revoked] = {}
    for name, entry in _data(text).get("revoked", {}).items():
        at, base = (
            (entry.get("at"), entry.get("base", 0)) if isinstance(entry, dict) else (entry, 0)
        )
        if not isinstance(at, int | float) or isinstance(at, bool) or not math.isfinite(at):
            continue  # not a time
        if name_problem(str(name)) is None:
            out[str(name)] = Revoked(float(at), base if _count(base) else 0)
    return out


def person_of(name: str, entry: object) -> Person | None:
    """One key of the file (or of the fleet's Redis), or None when it is not one `keys` wrote."""
    if name_problem(name) is not None or not isinstance(entry, dict):
        return None
    try:
        digest = bytes.fromhex(entry["sha256"])
        limits = [entry.get(k) for k in ("max_parallel", "rpm", "tpm")]
        priority, created = entry.get("priority", INTERACTIVE), float(entry["created"])
        rotated = entry.get("rotated")
        base = entry.get("base", 0)
    except (KeyError, TypeError, ValueError):
        return None
    bad_limit = any(not _count(v) for v in limits if v is not None)
    if len(digest) != 32 or bad_limit or priority not in PRIORITIES:
        return None
    max_parallel, rpm, tpm = limits
    return Person(
        name, digest, max_parallel, rpm, tpm, priority, created,
        float(rotated) if isinstance(rotated, int | float) else None,
        base if _count(base) else 0,
    )  # fmt: skip


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def entry_of(person: Person) -> dict[str, object]:
    """A key as the file (and the fleet's Redis) keeps it: its hash, never its secret."""
    public = {k: v for k, v in person.public().items() if k != "name"}
    entry: dict[str, object] = {"sha256": person.digest.hex(), **public}
    if person.base:
        entry["base"] = person.base
    return entry


def dump_keys(people: Mapping[str, Person], revoked: Mapping[str, Revoked] | None = None) -> str:
    keys = {p.name: entry_of(p) for p in sorted(people.values(), key=lambda p: p.name)}
    data: dict[str, object] = {"version": 1, "keys": keys}
    if revoked:
        data["revoked"] = {
            name: {"at": r.at, **({"base": r.base} if r.base else {})}
            for name, r in sorted(revoked.items())
        }
    return json.dumps(data, indent=2) + "\n"


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


def read_revoked(state_dir: Path) -> dict[str, Revoked]:
    try:
        return parse_revoked((state_dir / KEYS_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}


class Edited(dict[str, Person]):
    """The people a `keys` command changes, and every name that was among them in the block: a
    key of another front door taken in to be revoked here is kept as revoked too."""

    def __init__(self, people: Mapping[str, Person]) -> None:
        super().__init__(people)
        self.seen = set(people)

    def __setitem__(self, name: str, person: Person) -> None:
        self.seen.add(name)
        super().__setitem__(name, person)


@contextmanager
def editing(
    state_dir: Path, owner: int | None = None, base_of: Callable[[str], int] | None = None
) -> Iterator[dict[str, Person]]:
    """The people, to change in the block; written back whole, atomically and synced, when the
    block ends without an error. One `keys` command at a time (an flock): none loses another's
    change. `owner`: the uid the file belongs to (the proxy's user on a system install);
    `base_of`: in a fleet, the number of a name's last change there (appliance.keyorder)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / KEYS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        people = Edited(read_keys(state_dir))
        before = dict(people)
        yield people
        # In a fleet, each change is made over the fleet's last change of its name as this door
        # knows it: its base.
        base = base_of or (lambda name: 0)
        for name, person in list(people.items()):
            if before.get(name) != person:
                dict.__setitem__(people, name, replace(person, base=base(name)))
        # A key taken away is kept as revoked, for the peers (keyorder); one made again under
        # its name is not.
        was = read_revoked(state_dir)
        revoked = {n: r for n, r in was.items() if n not in people}
        revoked.update(
            {
                n: Revoked(time.time(), base(n))
                for n in people.seen  # revoked in this block, again or for the first time
                if n not in people
            }
        )
        if dict(people) != before or revoked != was:
            text = dump_keys(people, revoked)
            write_atomic(state_dir / KEYS_FILE, text, mode=0o600, owner=owner)
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
        self.revoked: dict[str, Revoked] = {}
        # The fleet's hash as last read and the order numbers of this door's changes
        # (appliance.proxy.share.fleet sets them; None: this door alone), and the keys in force
        # from them and this file, made again when either changes.
        self.remote: Mapping[str, object] | None = None
        self.settled: Mapping[str, int] = {}
        # How they are merged with this door's file (FleetKeys sets appliance.keyorder's)
        self.merge: Callable[..., dict[str, Person]] | None = None
        self.fleet: dict[str, Person] = {}
        self.changes = 0  # of the file's keys or the fleet's hash
        self.merged = -1  # the changes the fleet's keys were made from
        self.seen: tuple[int, ...] | None = None  # the file read last: inode, times, size
        self.looked = -math.inf
        self.problem: str | None = None  # why the file could not be read, said once

    def who(self, given: str) -> Person | None:
        return identify(given, self.master(), self.current())

    def current(self) -> Mapping[str, Person]:
        self.local()
        if self.remote is None:
            return self.people
        if self.changes != self.merged and self.merge is not None:  # merged at once
            self.fleet = self.merge(self.people, self.revoked, self.remote, self.settled)
            self.merged = self.changes
        return self.fleet

    def take_remote(self, remote: Mapping[str, object], settled: Mapping[str, int]) -> None:
        """The fleet's hash as just read, and the numbers of this door's changes
        (appliance.proxy.share.fleet)."""
        if remote != self.remote or settled != self.settled:
            self.remote, self.settled = dict(remote), dict(settled)
            self.changes += 1

    def local(self) -> Mapping[str, Person]:
        """This door's own keys file, looked at every LOOK_EVERY_S."""
        now = self.clock()
        if self.path is not None and now - self.looked >= LOOK_EVERY_S:
            self.looked = now
            self.refresh(self.path)
        return self.people

    def refresh(self, path: Path) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if self.seen is not None or self.people:
                self.changes += 1
            self.people, self.seen, self.problem = {}, None, None  # no keys file: no people
            self.revoked = {}
            return
        except OSError as e:
            self.unreadable(path, e.strerror or str(e))
            return
        seen = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)  # ctime: a chmod too
        if seen == self.seen:
            return
        self.seen = seen
        try:
            text = path.read_text()
            self.people, self.revoked = parse_keys(text), parse_revoked(text)
            self.changes += 1
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
