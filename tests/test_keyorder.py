"""The fleet's keys in one order (appliance.keyorder): which change of a name is in force on a
door, from its own file, the fleet's hash and the numbers Redis gave; no clock decides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance import keyorder, people
from appliance.hold import HELD_DIR
from appliance.keyorder import fingerprint, fleet_view
from appliance.people import Revoked


def _person(name: str, secret: str, when: float = 10.0, base: int = 0) -> people.Person:
    return people.Person(name, people.digest_of(secret), created=when, base=base)


def _theirs(person: people.Person, seq: int) -> dict[str, object]:
    return {"seq": seq, **people.entry_of(person)}


def test_a_change_made_over_the_fleets_last_is_in_force_at_once_and_published() -> None:
    old = _person("alice", "a1")
    mine = {"alice": _person("alice", "a2", when=5.0, base=3)}  # rotated here, by a slow clock
    view = fleet_view(mine, {}, {"alice": _theirs(old, 3)}, {})
    assert view.people["alice"].digest == people.digest_of("a2")
    assert view.pending == {"alice": people.entry_of(mine["alice"])}


def test_a_change_that_did_not_see_the_fleets_later_one_waits_for_its_number() -> None:
    """Made over number 3 while the fleet went on to 4: the fleet's stands until Redis says
    (it will say the change lost), whatever time either was made at."""
    mine = {"alice": _person("alice", "a2", when=1e12, base=3)}  # a far-future clock
    theirs = {"alice": _theirs(_person("alice", "a9"), 4)}
    view = fleet_view(mine, {}, theirs, {})
    assert view.people["alice"].digest == people.digest_of("a9")
    assert set(view.pending) == {"alice"}
    lost = {fingerprint("alice", people.entry_of(mine["alice"])): 0}
    view = fleet_view(mine, {}, theirs, lost)
    assert view.people["alice"].digest == people.digest_of("a9") and view.pending == {}


def test_a_revocation_wins_over_a_change_it_did_not_see_and_a_later_key_wins_over_it() -> None:
    theirs = {"bob": _theirs(_person("bob", "b2", when=1e12), 7)}
    revoked = {"bob": Revoked(at=0.0, base=5)}  # revoked here over number 5, by a slow clock
    view = fleet_view({}, revoked, theirs, {})
    assert "bob" not in view.people and set(view.pending) == {"bob"}
    # Ordered as number 8; then bob made again on another door, as number 9
    mark = fingerprint("bob", keyorder.revoked_entry(revoked["bob"]))
    again = {"bob": _theirs(_person("bob", "b3", base=8), 9)}
    view = fleet_view({}, revoked, again, {mark: 8})
    assert view.people["bob"].digest == people.digest_of("b3") and view.pending == {}


def test_a_change_the_fleet_holds_is_known_as_ordered_and_one_it_lost_is_published_again() -> None:
    alice = _person("alice", "a1")
    entry = people.entry_of(alice)
    view = fleet_view({"alice": alice}, {}, {"alice": _theirs(alice, 2)}, {})
    assert view.pending == {} and view.ordered == {fingerprint("alice", entry): 2}
    view = fleet_view({"alice": alice}, {}, {}, view.ordered)  # Redis emptied
    assert set(view.people) == {"alice"} and view.pending == {"alice": entry}


def test_entries_that_are_not_a_doors_are_passed_over() -> None:
    remote = {"bad name!": {"sha256": "00", "seq": 1}, "x": "junk", "y": {"seq": "z"}}
    assert fleet_view({}, {}, remote, {}).people == {}


def test_a_change_on_a_door_takes_the_fleets_number_of_its_name_as_its_base(tmp_path: Path) -> None:
    held = tmp_path / HELD_DIR
    held.mkdir()
    carol = _person("carol", "c1")
    fleet = {"carol": _theirs(carol, 6), "dave": {"seq": 4, "revoked": 1.0}}
    (held / keyorder.FLEET_FILE).write_text(keyorder.dump_fleet(fleet, {}))
    with people.editing(tmp_path, base_of=keyorder.fleet_bases(tmp_path)) as everyone:
        everyone["carol"] = carol  # `keys revoke carol`, a key made on another door
        del everyone["carol"]
        people.added(everyone, "dave", people.new_secret())  # made again
        people.added(everyone, "erin", people.new_secret())
    assert people.read_revoked(tmp_path)["carol"].base == 6
    mine = people.read_keys(tmp_path)
    assert mine["dave"].base == 4 and mine["erin"].base == 0
    _, in_force = keyorder.keys_in_force(tmp_path)
    assert set(in_force) == {"dave", "erin"}


def test_a_revocation_an_earlier_version_wrote_is_read_as_over_nothing(tmp_path: Path) -> None:
    text = json.dumps({"version": 1, "keys": {}, "revoked": {"alice": 12.5, "bob": "x"}})
    (tmp_path / people.KEYS_FILE).write_text(text)
    assert people.read_revoked(tmp_path) == {"alice": Revoked(12.5, 0)}


def test_a_door_of_a_fleet_takes_its_own_files_change_at_its_next_look(tmp_path: Path) -> None:
    clock = [0.0]
    ring = people.KeyRing(tmp_path / people.KEYS_FILE, lambda: "", clock=lambda: clock[0])
    ring.merge = lambda *mine_and_theirs: fleet_view(*mine_and_theirs).people
    ring.take_remote({"carol": _theirs(_person("carol", "c1", 30.0), 1)}, {})
    assert set(ring.current()) == {"carol"}
    with people.editing(tmp_path) as everyone:
        people.added(everyone, "alice", people.new_secret())
    clock[0] += people.LOOK_EVERY_S  # the file's next look, not the fleet's next read
    assert set(ring.current()) == {"alice", "carol"}


def test_a_failure_in_a_fleet_loop_is_said_once_with_its_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the key merge is in the journal, once while it lasts, and its end too."""
    import asyncio

    from appliance.proxy.share import fleet

    class Redis:
        async def hgetall(self, name: str) -> dict[bytes, bytes]:
            return {}

    ring = people.KeyRing(None, lambda: "")
    broken = [True]

    def local() -> dict[str, people.Person]:
        if broken[0]:
            raise RuntimeError("a merge that went wrong")
        return {}

    monkeypatch.setattr(ring, "local", local)
    monkeypatch.setattr(fleet, "LOOK_EVERY_S", 0.01)
    keys = fleet.FleetKeys(ring, Redis(), tmp_path)

    async def main() -> None:
        task = asyncio.ensure_future(keys.run())
        await asyncio.sleep(0.2)
        broken[0] = False
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    said = capsys.readouterr().err
    assert said.count("RuntimeError: a merge that went wrong") == 1, said
    assert said.count("keeping the fleet's keys works again") == 1, said
