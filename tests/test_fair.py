"""Fair turns at a full runtime (appliance.proxy.share.turns, .fair): who goes next, as a pure
choice, and the turns the proxy's workers share through their record; in milliseconds."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance import people
from appliance.hold import start_time
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
    assert len(fill(alone, 2, 0.0, 30.0)) == 3  # one waits in the runtime, ready to start
    alone.seen = {"b": 0.0}  # another key came within ACTIVE_S: no more than the places
    alone.end("1:x", "a")  # one ended: two run, the runtime's places
    assert fill(alone, 2, 0.0, 30.0) == []
    assert fill(alone, 2, 0.0, 30.0, keep_free=1) == []  # places kept: nothing more


def test_batch_keys_leave_a_place_for_whoever_comes_while_they_fill_the_runtime() -> None:
    """A batch crowd on two places, and an interactive key that came within ACTIVE_S: the crowd
    holds one place, and the other waits for the person, who starts at once."""
    t = Turns.of([_entry(i, "crowd", since=i, kind=BATCH) for i in range(5000)])
    t.seen = {"crowd": 0.0, "light": 1.0}
    granted = fill(t, 2, 2.0, 30.0)
    assert [e.key for e in granted] == ["crowd"] and t.count() == 1
    t.add(_entry(9000, "light", since=3.0))
    assert [e.key for e in fill(t, 2, 3.0, 30.0)] == ["light"]
    # Batch requests aged past batch_wait_s take no more than that either.
    t.end("1:x", "light")
    assert fill(t, 2, 25.0, 10.0) == []
    # Once nobody else came within ACTIVE_S, the crowd takes every place (one more, alone).
    assert [e.key for e in fill(t, 2, 1.0 + turns.ACTIVE_S, 30.0)] == ["crowd", "crowd"]


def test_batch_share_bounds_what_a_batch_crowd_holds_beside_a_person() -> None:
    """[proxy] batch_share = 0.4 on vLLM's 64 places: the crowd holds 25 while light came within
    ACTIVE_S, one at least on two places; the door's setting reaches the turns."""
    t = Turns.of([_entry(i, "crowd", since=i, kind=BATCH) for i in range(5000)])
    t.seen = {"crowd": 0.0, "light": 1.0}
    assert len(fill(t, 64, 2.0, 30.0, batch_share=0.4)) == 25 and t.count() == 25
    two = Turns.of([_entry(i, "crowd", since=i, kind=BATCH) for i in range(10)])
    two.seen = {"crowd": 0.0, "light": 1.0}
    assert len(fill(two, 2, 2.0, 30.0, batch_share=0.1)) == 1
    from appliance.proxy.mount import batch_share

    assert batch_share({"B70_BATCH_SHARE": "0.4"}) == 0.4
    assert batch_share({}) == batch_share({"B70_BATCH_SHARE": "nan"}) == 1.0
    assert batch_share({"B70_BATCH_SHARE": "0"}) == batch_share({"B70_BATCH_SHARE": "7"}) == 1.0


def test_a_person_running_all_the_time_does_not_starve_a_batch_key() -> None:
    """The bound is on what batch keys hold, not on the last place free: with one interactive
    request always running on two places, the batch key still gets the other."""
    t = Turns.of([_entry(i, "crowd", since=i, kind=BATCH) for i in range(10)])
    t.add(_entry(100, "light", since=0.0))
    t.seen = {"crowd": 0.0, "light": 0.0}
    assert sorted(e.key for e in fill(t, 2, 1.0, 30.0)) == ["crowd", "light"]
    t.end("1:x", "crowd")
    assert [e.key for e in fill(t, 2, 2.0, 30.0)] == ["crowd"]
    # One place: a batch key is never held back (it would wait for nobody).
    one = Turns.of([_entry(i, "crowd", since=i, kind=BATCH) for i in range(3)])
    one.seen = {"crowd": 0.0, "light": 0.0}
    assert [e.key for e in fill(one, 1, 1.0, 30.0)] == ["crowd"]


def test_a_cost_counts_the_prompt_and_the_answer_asked() -> None:
    assert turns.cost_of(4000, 100) == 1100
    assert turns.cost_of(40, 0) == 10 + 512
    assert turns.cost_of(10**9, 10**9) == turns.MOST_COST


# --- the shared record and the worker's side --------------------------------------------------


def test_the_third_request_waits_for_a_place_and_gets_it_when_one_ends(tmp_path: Path) -> None:
    async def run() -> None:
        share = fair.Share(tmp_path, 8001, 30.0)
        first = await share.enter("heavy", INTERACTIVE, 100, 2, 5.0)
        await share.enter("heavy", INTERACTIVE, 100, 2, 5.0)
        third = asyncio.ensure_future(share.enter("light", INTERACTIVE, 10, 2, 5.0))
        await asyncio.sleep(0.05)
        assert not third.done()
        share.leave(first)
        await asyncio.wait_for(third, 1.0)

    asyncio.run(run())


def test_a_turn_given_before_its_request_waits_for_it_is_kept(tmp_path: Path) -> None:
    """The door takes its place in line, then waits in a task of its own: a place freed between
    the two (another request ended) is the request's turn, not an error (CI, session 19)."""

    async def run() -> None:
        share = fair.Share(tmp_path, 8001, 30.0)
        running = share.enter_now("heavy", INTERACTIVE, 100, 1)
        waiting = share.enter_now("light", INTERACTIVE, 10, 1)
        assert isinstance(running, fair.Turn) and isinstance(waiting, fair.Waiting)
        share.leave(running)  # before `waiting` waits
        turn = await asyncio.wait_for(waiting.turn(1.0), 1.0)
        assert turn.key == "light"
        with share.record.open() as t:
            assert list(t.running().values()) == [{"light": 1}]

    asyncio.run(run())


def test_a_place_another_worker_frees_is_seen_by_the_poll(tmp_path: Path) -> None:
    async def run() -> None:
        one, other = fair.Share(tmp_path, 8001, 30.0), fair.Share(tmp_path, 8001, 30.0)
        parent = os.getppid()  # another worker: a process that is alive, not this one
        other.me = f"{parent}:{start_time(parent)}"
        running = await one.enter("heavy", INTERACTIVE, 100, 1, 5.0)
        waiting = asyncio.ensure_future(other.enter("light", INTERACTIVE, 10, 1, 5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        one.leave(running)  # admits `other`'s request in the record; its poll sees it
        await asyncio.wait_for(waiting, 1.0)

    asyncio.run(run())


def test_a_request_that_waits_too_long_or_is_cancelled_leaves_its_place(tmp_path: Path) -> None:
    async def run() -> None:
        share = fair.Share(tmp_path, 8001, 30.0)
        running = await share.enter("heavy", INTERACTIVE, 100, 1, 5.0)
        with pytest.raises(HoldTimeout):
            await share.enter("light", INTERACTIVE, 10, 1, 0.05)
        gone = asyncio.ensure_future(share.enter("light", INTERACTIVE, 10, 1, 5.0))
        await asyncio.sleep(0.03)
        gone.cancel()  # its client left
        await asyncio.sleep(0.03)
        with share.record.open() as t:
            assert t.waiting_count() == 0 and len(t.running()) == 1
        share.leave(running)
        with share.record.open() as t:
            assert t.running() == {}

    asyncio.run(run())


def test_the_places_of_a_worker_that_died_are_freed(tmp_path: Path) -> None:
    record = turns.Record(tmp_path, 8001)
    with record.open() as t:  # a worker that is gone (pid 1 never started then)
        t.start("1:0", "ghost")
        t.add(Entry("1:0:1", "ghost", INTERACTIVE, 10, 0.0))

    async def run() -> None:
        share = fair.Share(tmp_path, 8001, 30.0)
        await asyncio.wait_for(share.enter("alive", INTERACTIVE, 10, 1, 1.0), 1.0)

    asyncio.run(run())


def test_a_record_cut_short_begins_again(tmp_path: Path) -> None:
    record = turns.Record(tmp_path, 8001)
    record.path.parent.mkdir(parents=True)
    record.path.write_text('{"running": [')  # not a database: a file of the old JSON, cut

    async def run() -> None:
        share = fair.Share(tmp_path, 8001, 30.0)
        await asyncio.wait_for(share.enter("k", INTERACTIVE, 10, 1, 1.0), 1.0)

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


@pytest.mark.parametrize("seed", range(40))
def test_one_request_waits_for_at_most_one_visit_of_each_other_key(seed: int) -> None:
    """docs/proxy.md: whoever has many queued, a person with one request waits for at most one
    visit of each other key, whatever its own request asks: that key's requests worth less than
    QUANTUM tokens, and the one that crosses it."""
    rng = random.Random(seed)
    others = [f"k{i}" for i in range(rng.randint(1, 4))]
    t = Turns.of()
    n = 0
    for i in range(64):
        for key in others:
            n += 1
            t.add(_entry(n, key, rng.choice([1, 10, 76, 128, 500, 3000]), since=i))
    for _ in range(rng.randint(0, 40)):  # the ring somewhere in its turns
        chosen = pick(t, 0.0, 30.0)
        assert chosen is not None
    t.add(_entry(10**6, "light", rng.choice([1, 522, 5000, turns.MOST_COST]), since=100))
    sent: dict[str, list[int]] = {key: [] for key in others}
    while (chosen := pick(t, 0.0, 30.0)) is not None and chosen.key != "light":
        sent[chosen.key].append(chosen.cost)
    assert chosen is not None and chosen.key == "light"
    for key, cost in sent.items():
        assert sum(cost[:-1]) < turns.QUANTUM, (key, cost)


def test_with_66_token_requests_queued_a_request_that_gives_no_max_tokens_waits_for_two() -> None:
    """The case the review measured: heavy's requests ask 66 tokens, light's none (512 counted);
    light waited behind 9 of heavy's. Now behind 2 at most, as docs/proxy.md says."""
    heavy = turns.cost_of(40, 66)
    t = Turns.of([_entry(i, "heavy", heavy, since=i) for i in range(64)])
    for _ in range(5):
        pick(t, 0.0, 30.0)
    t.add(_entry(100, "light", turns.cost_of(40, 0), since=100))
    assert _served(t, 3).index("light") <= 2


def _steps(t: Turns, work: Callable[[], object]) -> int:
    """SQLite's virtual machine steps, in tens, that `work` costs on the record `t`."""
    count = [0]

    def step() -> int:
        count[0] += 1
        return 0

    t.db.set_progress_handler(step, 10)
    try:
        work()
    finally:
        t.db.set_progress_handler(None, 100)
    return count[0]


def _one_in_and_out(crowd: int) -> tuple[Turns, Callable[[], object]]:
    """A record with `crowd` batch requests waiting and two running, and the work of one light
    request's way in and a batch request's way out."""
    t = Turns.of([_entry(i, "batch", 300, since=crowd, kind=BATCH) for i in range(crowd)])
    for _ in range(2):
        t.start("1:x", "batch")

    def one() -> None:
        t.add(_entry(10**6, "light", 40, since=float(crowd)))
        fill(t, 2, float(crowd), 30.0)
        t.end("1:x", "batch")
        assert [e.key for e in fill(t, 2, float(crowd), 30.0)] == ["light"]
        t.take_granted("1:x")

    return t, one


def test_a_way_in_and_out_costs_the_same_with_5000_waiting_as_with_5() -> None:
    """No request is read whole: the work of an enter (a row in, the choice) and a leave (a place
    freed, the next admitted) is counted in SQLite's own steps, with 5 and with 5,000 waiting."""
    cost = {crowd: _steps(*_one_in_and_out(crowd)) for crowd in (5, 5000)}
    assert cost[5000] <= cost[5] * 1.2 + 2, cost


_KILLED_WORKER = """
import sys, time
from pathlib import Path
from appliance.hold import start_time
from appliance.people import INTERACTIVE
from appliance.proxy.share.turns import Entry, Record
import os
me = f"{os.getpid()}:{start_time(os.getpid())}"
record = Record(Path(sys.argv[1]), 8001)
with record.open() as t:
    t.start(me, "gone")
    t.add(Entry(me + ":1", "gone", INTERACTIVE, 10, time.time()))
with record.open() as t:
    t.add(Entry(me + ":2", "gone", INTERACTIVE, 10, time.time()))
    print("in", flush=True)
    time.sleep(600)  # killed here, inside a change of the record, holding its lock
"""


def test_a_worker_killed_inside_a_change_holds_no_place_and_no_lock(tmp_path: Path) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "in\n"
    finally:
        worker.kill()
        worker.wait()

    async def run() -> None:
        share = fair.Share(tmp_path, 8001, 30.0)
        await asyncio.wait_for(share.enter("alive", INTERACTIVE, 10, 1, 3.0), 3.0)

    asyncio.run(run())
    with turns.Record(tmp_path, 8001).open() as t:
        assert t.running() == {share_me(): {"alive": 1}} and t.waiting_count() == 0


def share_me() -> str:
    return f"{os.getpid()}:{start_time(os.getpid())}"


def test_a_crowd_of_batch_requests_that_all_waited_long_takes_every_other_place_at_most() -> None:
    """Aged batch requests go first, so batch never starves; but 5,000 of them that all waited
    more than batch_wait_s do not starve an interactive request either."""
    t = Turns.of([_entry(i, "nightly", 10, since=0.0, kind=BATCH) for i in range(5000)])
    assert _served(t, 1, now=100.0) == ["nightly"]
    t.add(_entry(10**6, "light", 522, since=100.0))
    assert _served(t, 1, now=100.0) == ["light"]
    t.add(_entry(10**6 + 1, "light", 522, since=100.0))
    t.add(_entry(10**6 + 2, "light", 522, since=100.0))
    assert _served(t, 4, now=100.0) == ["nightly", "light", "nightly", "light"]


@pytest.mark.parametrize("break_it", ["folder", "database"])
def test_a_record_that_cannot_be_kept_lets_requests_go_as_they_come(
    tmp_path: Path, break_it: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The held folder is a file, or the record's database a folder: no turn is taken (the
    request goes to the runtime as it comes), and the journal says why, once."""
    held = tmp_path / "held"
    if break_it == "folder":
        held.write_text("not a folder")
    else:
        (held / "turns-8001.db").mkdir(parents=True)
    doors = fair.Fair(tmp_path, {(8001, "llama.cpp"): 1})
    person = people.Person("alice", b"a" * 32)

    class Known:
        url = "http://127.0.0.1:8001"
        known = type("Facts", (), {"slots": 1, "engine": "llama.cpp"})()

    for _ in range(3):
        assert doors.enter_now(person, Known(), 10) is None  # type: ignore[arg-type]
    said = capsys.readouterr().err
    assert said.count("cannot keep fair turns") == 1, said
