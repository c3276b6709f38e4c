"""Fair turns at a full runtime (appliance.proxy.share.turns, .fair): who goes next, as a pure
choice, and the turns the proxy's workers share through their record; in milliseconds."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from appliance.people import BATCH, INTERACTIVE
from appliance.proxy.share import fair, turns
from appliance.proxy.share.turns import Entry, Turns, fill, pick
from appliance.proxy.waiting import HoldTimeout


def _entry(n: int, key: str, cost: int = 100, since: float = 0.0, kind: str = INTERACTIVE) -> Entry:
    return Entry(f"1:x:{n}", key, kind, cost, since)


def _served(t: Turns, picks: int, now: float = 0.0, wait_s: float = 30.0) -> list[str]:
    out = []
    for _ in range(picks):
        chosen = pick(t, now, wait_s)
        if chosen is None:
            break
        out.append(chosen.key)
    return out


def test_one_request_goes_after_at_most_one_of_anothers_many() -> None:
    t = Turns.of([_entry(i, "heavy", 150, since=i) for i in range(64)])
    assert _served(t, 3) == ["heavy"] * 3
    t.add(_entry(100, "light", 40, since=100))
    assert "light" in _served(t, 2)


def test_keys_share_tokens_not_requests() -> None:
    """Two keys always waiting, one asking 10 times the tokens of the other: about the same
    tokens each, so the small one gets about 10 times the requests."""
    t = Turns.of([_entry(i, "big", 1000, i) for i in range(100)])
    for i in range(1000):
        t.add(_entry(1000 + i, "small", 100, i))
    served = _served(t, 330)
    tokens = {k: served.count(k) * (1000 if k == "big" else 100) for k in ("big", "small")}
    assert 0.8 < tokens["big"] / tokens["small"] < 1.25, tokens


def test_three_keys_take_turns_in_a_ring() -> None:
    t = Turns.of([_entry(i * 3 + j, k, 128, i) for i in range(10) for j, k in enumerate("abc")])
    served = _served(t, 9)
    assert sorted(served[:3]) == ["a", "b", "c"] and sorted(served[3:6]) == ["a", "b", "c"]


def test_interactive_goes_before_batch_until_batch_has_waited_its_limit() -> None:
    t = Turns.of([_entry(1, "nightly", since=0.0, kind=BATCH), _entry(2, "alice", since=5.0)])
    t.add(_entry(3, "bob", since=6.0))
    assert _served(t, 2, now=10.0) == ["alice", "bob"]
    t.add(_entry(4, "alice", since=20.0))
    assert _served(t, 1, now=31.0) == ["nightly"]  # waited 31 s, more than its 30
    assert _served(t, 1, now=31.0) == ["alice"]


def test_fill_admits_up_to_the_slots_and_one_more_for_a_key_alone() -> None:
    t = Turns.of([_entry(2 * i + j, k) for i in range(5) for j, k in enumerate("ab")])
    assert len(fill(t, 2, 0.0, 30.0)) == 2 and t.count() == 2 and t.waiting_count() == 8
    assert fill(t, 2, 0.0, 30.0) == []
    alone = Turns.of([_entry(i, "a") for i in range(5)])
    admitted = fill(alone, 2, 0.0, 30.0)
    assert len(admitted) == 3  # one waits in the runtime, ready to start
    alone.seen = {"b": 0.0}  # another key came within ACTIVE_S: no more than the places
    alone.end(admitted[0].id)  # one ended: two run, the runtime's places
    assert fill(alone, 2, 0.0, 30.0) == []
    assert fill(alone, 2, 0.0, 30.0, keep_free=1) == []  # places kept: nothing more


def test_a_cost_counts_the_prompt_and_the_answer_asked() -> None:
    assert turns.cost_of(4000, 100) == 1100
    assert turns.cost_of(40, 0) == 10 + 512
    assert turns.cost_of(10**9, 10**9) == turns.MOST_COST


def test_a_request_that_leaves_the_line_is_passed_over_and_counted_out_at_once() -> None:
    t = Turns.of([_entry(i, "heavy", since=i) for i in range(5)] + [_entry(9, "light", since=9)])
    assert t.leave_queue("1:x:0") and t.leave_queue("1:x:9") and not t.leave_queue("1:x:9")
    assert t.waiting_count() == 4
    assert [e.id for e in fill(t, 2, 10.0, 30.0)] == ["1:x:1", "1:x:2", "1:x:3"]  # heavy alone


# --- the usher: one worker keeps the turns, the others ask it ------------------------------------


def _person(name: str) -> Any:
    from appliance.people import Person

    return Person(name, b"x" * 32)


class _Backend:
    """What the door's checks leave for the runtime: its URL and what it said it is."""

    def __init__(self, slots: int) -> None:
        from appliance.proxy.backend import Facts

        self.url = "http://127.0.0.1:8001"
        self.known = Facts(engine="llama.cpp", context=2048, model="m", slots=slots)


async def _take(f: fair.Fair, key: str, slots: int, limit: float = 5.0) -> fair.Turn:
    waiting = f.enter_now(_person(key), _Backend(slots), 100)  # type: ignore[arg-type]
    assert waiting is not None
    return await waiting.turn(limit)


def test_the_third_request_waits_for_a_place_and_gets_it_when_one_ends(tmp_path: Path) -> None:
    async def run() -> None:
        f = fair.Fair(tmp_path, {})
        first = await _take(f, "heavy", 2)
        await _take(f, "heavy", 2)
        third = asyncio.ensure_future(_take(f, "light", 2))
        await asyncio.sleep(0.05)
        assert not third.done()
        f.leave(first)
        await asyncio.wait_for(third, 1.0)

    asyncio.run(run())


def test_a_turn_given_before_its_request_waits_for_it_is_kept(tmp_path: Path) -> None:
    """The door takes its place in line, then waits in a task of its own: a place freed between
    the two (another request ended) is the request's turn, not an error (CI, session 19)."""

    async def run() -> None:
        f = fair.Fair(tmp_path, {})
        running = await _take(f, "heavy", 1)
        waiting = f.enter_now(_person("light"), _Backend(1), 10)  # type: ignore[arg-type]
        assert waiting is not None
        f.leave(running)  # before `waiting` waits
        turn = await asyncio.wait_for(waiting.turn(1.0), 1.0)
        assert turn.key == "light" and f.usher.keeper is not None
        assert f.usher.keeper.ports[8001].turns.running == {turn.id: "light"}

    asyncio.run(run())


def test_a_request_that_waits_too_long_or_is_cancelled_leaves_its_place(tmp_path: Path) -> None:
    async def run() -> None:
        f = fair.Fair(tmp_path, {})
        running = await _take(f, "heavy", 1)
        with pytest.raises(HoldTimeout):
            await _take(f, "light", 1, limit=0.05)
        gone = asyncio.ensure_future(_take(f, "light", 1))
        await asyncio.sleep(0.03)
        gone.cancel()  # its client left
        await asyncio.sleep(0.03)
        assert f.usher.keeper is not None
        turns_now = f.usher.keeper.ports[8001].turns
        assert turns_now.waiting_count() == 0 and turns_now.count() == 1
        f.leave(running)
        assert turns_now.count() == 0

    asyncio.run(run())


# A worker of its own, in another process: it takes `slots` places on port 8001 (with the
# usher, or as it), says "took", and holds them until it is killed.
HOLDER = """
import asyncio, sys
from pathlib import Path
from appliance.proxy.share import fair
from appliance.people import Person
from appliance.proxy.backend import Facts

class Backend:
    url = "http://127.0.0.1:8001"
    known = Facts(engine="llama.cpp", context=2048, model="m", slots=max(1, int(sys.argv[2])))

async def main():
    f = fair.Fair(Path(sys.argv[1]), {})
    assert await f.usher.ready()
    for _ in range(int(sys.argv[2])):
        await f.enter_now(Person("ghost", b"x" * 32), Backend(), 10).turn(10)
    print("took", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _holder(tmp_path: Path, slots: int) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), str(slots)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == "took"
    return child


@pytest.mark.parametrize("holder_first", [True, False], ids=["usher-dies", "follower-dies"])
def test_the_places_of_a_worker_that_died_are_freed(tmp_path: Path, holder_first: bool) -> None:
    """Another worker holds the runtime's one place and is killed (SIGKILL): the place is this
    worker's next request's, whether the one killed was the usher (then this worker becomes
    it) or followed it."""

    async def run() -> None:
        f = fair.Fair(tmp_path, {})
        if not holder_first:  # this worker the usher, the holder its follower
            f.leave(await _take(f, "warm", 1))
        child = await asyncio.to_thread(_holder, tmp_path, 1)
        try:
            waiting = asyncio.ensure_future(_take(f, "alive", 1))
            await asyncio.sleep(0.2)
            assert not waiting.done(), "the place is the holder's while it lives"
            child.kill()
            await asyncio.wait_for(waiting, 3.0)
            assert f.usher.keeper is not None  # it took over, or was the usher all along
        finally:
            child.kill()
            child.wait()

    asyncio.run(run())


def test_a_new_usher_counts_what_still_runs_before_it_admits_anyone(tmp_path: Path) -> None:
    """The usher dies while this worker runs a request: the new usher (this worker) knows it
    runs, so a second request waits for it on a runtime of one place."""

    async def run() -> None:
        child = await asyncio.to_thread(_holder, tmp_path, 0)  # the usher, holding nothing
        f = fair.Fair(tmp_path, {})
        try:
            running = await _take(f, "mine", 1)
            assert f.usher.keeper is None, "the other process is the usher"
            child.kill()
            await asyncio.sleep(0.1)
            second = asyncio.ensure_future(_take(f, "other", 1))
            await asyncio.sleep(0.6)
            assert f.usher.keeper is not None and not second.done()
            f.leave(running)
            await asyncio.wait_for(second, 1.0)
        finally:
            child.kill()
            child.wait()

    asyncio.run(run())


def test_slots_come_from_the_renderers_words() -> None:
    assert fair.parse_slots("8001/vLLM=256 8002/llama.cpp=4 bad 8003/x=0") == {
        (8001, "vLLM"): 256,
        (8002, "llama.cpp"): 4,
    }


def test_a_kept_place_goes_to_a_key_with_nothing_running_while_another_fills_the_rest() -> None:
    t = Turns.of([_entry(i, "heavy", since=i) for i in range(10)])
    t.seen = {"heavy": 0.0, "light": 0.0}  # light came within ACTIVE_S
    assert [e.key for e in fill(t, 2, 1.0, 30.0, keep_free=1)] == ["heavy"]  # one place kept
    t.add(_entry(100, "light", since=1.0))
    assert [e.key for e in fill(t, 2, 1.0, 30.0, keep_free=1)] == ["light"]  # at once


def test_a_kept_place_is_anyones_while_no_other_key_came_lately() -> None:
    t = Turns.of([_entry(i, "heavy", since=i) for i in range(10)])
    t.seen = {"heavy": 100.0, "light": 100.0 - turns.ACTIVE_S - 1}
    assert [e.key for e in fill(t, 2, 100.0, 30.0, keep_free=1)] == ["heavy", "heavy"]


def test_the_appliances_own_probes_do_not_count_as_another_key() -> None:
    t = Turns.of([_entry(i, "heavy", since=i) for i in range(5)])
    t.seen = {"heavy": 0.0, "master": 0.0}  # the monitor's probe, with the master key
    assert turns.alone(t, 1.0)
    t.seen["light"] = 0.5
    assert not turns.alone(t, 1.0)
