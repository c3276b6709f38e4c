"""The fleet's keys in one order: front doors that share a Redis ([peers] redis_host) share their
people's keys in one hash, and Redis, not any door's clock, orders every change.

A change made with `b70ctl keys` on one door (a key made, rotated, its limits changed, or
revoked) is written to that door's keys file with its base: the order number of that name's
change in the fleet as the door knew it then (0: none). Each proxy worker publishes its door's
changes through one Lua script (ORDER), which gives each the next number of a counter in Redis
(FLEET_SEQ) and writes it to the hash (FLEET_KEYS: name -> the entry, with its "seq"), unless the
name changed in the fleet since the base and the change is not a revocation against a change that
is not one: then the change lost to one it did not see, and the door takes the fleet's. So:
- the highest number wins, and numbers come from one counter, in the order Redis ran the scripts;
- a revocation made anywhere wins over every change made before it, and over every change made
  at the same time that did not see it;
- nothing outlives a later revocation, whatever time the door that wrote it keeps: the times
  a key shows (made, rotated, revoked) are each door's own, for people, and order nothing.

Each change's fingerprint (its entry's SHA-256) and the number it got are kept in Redis
(FLEET_ORDER, "name<TAB>fingerprint" -> the number, 0: lost), so a door that asks again is told
the same, and in each door's held/keys-fleet.json (FLEET_FILE, with the hash as last read), so
that `b70ctl keys` and a restarted worker know which of the file's changes are ordered.

Imported by the proxy: nothing from the rest of the controller but appliance.people and what it
imports.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from appliance.hold import HELD_DIR
from appliance.people import Person, Revoked, entry_of, person_of, read_keys, read_revoked

FLEET_KEYS = "b70:keys"  # name -> the entry of its last change, with "seq"
FLEET_SEQ = "b70:keys:seq"  # the counter
FLEET_ORDER = "b70:keys:order"  # "name<TAB>fingerprint" -> the number that change got (0: lost)
FLEET_FILE = "keys-fleet.json"  # in HELD_DIR: the hash and the numbers as this door last knew them

# ORDER's arguments: KEYS = FLEET_KEYS, FLEET_ORDER, FLEET_SEQ; ARGV = the name, the change's
# fingerprint, its base, its entry (a JSON object, without "seq"), 1 for a revocation. It returns
# the change's number, or 0 when it lost. The entry is written as the door sent it, its number
# put in front, so that it reads back exactly as sent.
ORDER = """
local name, fp, base, entry, gone = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5] == '1'
local known = redis.call('HGET', KEYS[2], name .. '\\t' .. fp)
if known then return tonumber(known) end
local current = redis.call('HGET', KEYS[1], name)
if current then
  local ok, doc = pcall(cjson.decode, current)
  if ok and type(doc) == 'table' then
    local seq = tonumber(doc['seq']) or 0
    if seq > base and not (gone and doc['revoked'] == nil) then
      redis.call('HSET', KEYS[2], name .. '\\t' .. fp, 0)
      return 0
    end
  end
end
local seq = redis.call('INCR', KEYS[3])
local body = string.sub(entry, 2)
if body ~= '}' then body = ', ' .. body end
redis.call('HSET', KEYS[1], name, '{"seq": ' .. seq .. body)
redis.call('HSET', KEYS[2], name .. '\\t' .. fp, seq)
return seq
"""


def revoked_entry(revoked: Revoked) -> dict[str, object]:
    entry: dict[str, object] = {"revoked": revoked.at}
    if revoked.base:
        entry["base"] = revoked.base
    return entry


def local_entries(
    local: Mapping[str, Person], revoked: Mapping[str, Revoked]
) -> dict[str, dict[str, object]]:
    """This door's own last change of each name, as the fleet's hash would hold it."""
    mine = {name: revoked_entry(r) for name, r in revoked.items()}
    mine.update({name: entry_of(p) for name, p in local.items()})
    return mine


def fingerprint(name: str, entry: Mapping[str, object]) -> str:
    """A change's name in FLEET_ORDER: its name, a tab, its entry's SHA-256 (hex)."""
    text = json.dumps(entry, sort_keys=True, separators=(",", ":"))
    return f"{name}\t{hashlib.sha256(text.encode()).hexdigest()}"


def seq_of(entry: object) -> int:
    seq = entry.get("seq") if isinstance(entry, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0 else 0


def is_revocation(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("revoked"), int | float)


def content(entry: Mapping[str, object]) -> dict[str, object]:
    return {k: v for k, v in entry.items() if k != "seq"}


@dataclass
class View:
    """The keys in force on a door of a fleet, and what of its own it has to publish."""

    people: dict[str, Person]
    pending: dict[str, dict[str, object]]  # name -> its change here, not yet ordered
    ordered: dict[str, int]  # fingerprints of this door's changes that the fleet holds as they are


def fleet_view(
    local: Mapping[str, Person],
    revoked: Mapping[str, Revoked],
    remote: Mapping[str, object],
    settled: Mapping[str, int],
) -> View:
    """The keys in force from this door's file (`local`, `revoked`), the fleet's hash as last
    read (`remote`, parsed JSON) and the numbers its own changes got (`settled`: fingerprint ->
    number, 0 for one that lost). A change of this door's that is not yet ordered is in force
    here at once when the fleet's has not changed since its base, or when it revokes a key."""
    mine = local_entries(local, revoked)
    pending: dict[str, dict[str, object]] = {}
    ordered: dict[str, int] = {}
    people: dict[str, Person] = {}
    for name in sorted(set(mine) | set(remote)):
        theirs = remote.get(name)
        if not isinstance(theirs, dict):
            theirs = None
        last = seq_of(theirs)
        own = mine.get(name)
        winner: Mapping[str, object] | None = theirs
        if own is not None and theirs is not None and content(theirs) == own:
            ordered[fingerprint(name, own)] = last
        elif own is not None:
            got = settled.get(fingerprint(name, own))
            if got is None:  # not ordered yet: to publish, in force here while it can win
                pending[name] = own
                base = own.get("base", 0)
                newer = theirs is None or last <= (base if isinstance(base, int) else 0)
                if newer or (is_revocation(own) and not is_revocation(theirs)):
                    winner = own
            elif got > 0 and last <= got:  # ordered, and the hash lost it (Redis emptied)
                pending[name] = own
                winner = own
        if winner is not None and not is_revocation(winner):
            person = person_of(name, winner)
            if person is not None:
                people[name] = person
    return View(people, pending, ordered)


def read_fleet(state_dir: Path) -> tuple[dict[str, object], dict[str, int]]:
    """The fleet's hash and the numbers of this door's changes as its proxy last wrote them
    (FLEET_FILE): empty without a fleet, or when the file cannot be read."""
    try:
        data = json.loads((state_dir / HELD_DIR / FLEET_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}, {}
    if not isinstance(data, dict) or not isinstance(data.get("keys"), dict):
        return {}, {}
    settled = data.get("settled")
    numbers = {
        str(k): v
        for k, v in (settled.items() if isinstance(settled, dict) else ())
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0
    }
    return {str(n): e for n, e in data["keys"].items()}, numbers


def dump_fleet(remote: Mapping[str, object], settled: Mapping[str, int]) -> str:
    data = {
        "version": 2,
        "keys": dict(sorted(remote.items())),
        "settled": dict(sorted(settled.items())),
    }
    return json.dumps(data, indent=2) + "\n"


def keys_in_force(state_dir: Path) -> tuple[dict[str, Person], dict[str, Person]]:
    """This door's own keys, and the keys in force on it: its own with the fleet's, as the proxy
    last read them (the same as its own without a fleet). KeysUnreadable as read_keys."""
    local = read_keys(state_dir)
    remote, settled = read_fleet(state_dir)
    return local, fleet_view(local, read_revoked(state_dir), remote, settled).people


def fleet_bases(state_dir: Path) -> Callable[[str], int]:
    """The number of each name's last change in the fleet, as this door's proxy last read it
    (the file read once): the base of a change made now."""
    remote, _ = read_fleet(state_dir)
    return lambda name: seq_of(remote.get(name))
