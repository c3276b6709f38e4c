"""The request hold of appliance.hold: the turnstile, the mark and the counts, on real files and
a clock that the test moves; the same turnstile runs inside the real proxy in tests/test_hold_real.py
(and under LiteLLM's hook in tests/test_proxy_hook_real.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import hold
from appliance.proxy import waiting


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)  # let the rest of the test run, as a real sleep would


class Backend:
    """A probe whose answer the test sets; it counts how often it was asked."""

    def __init__(self, healthy: bool = True) -> None:
        self.healthy = healthy
        self.asked = 0

    async def __call__(self) -> bool:
        self.asked += 1
        return self.healthy


def turnstile(
    tmp_path: Path, backend: Backend, clock: Clock, hold_s: float = 10
) -> waiting.Turnstile:
    return waiting.Turnstile(tmp_path, backend, hold_s, clock=clock, sleep=clock.sleep)


def test_a_healthy_backend_without_a_mark_lets_requests_through_at_once(tmp_path: Path) -> None:
    clock, backend = Clock(), Backend()
    g = turnstile(tmp_path, backend, clock)
    assert asyncio.run(g.wait()) == 0.0
    assert asyncio.run(g.wait()) == 0.0
    assert backend.asked == 1, "a healthy answer is trusted for a while, not asked per request"
    clock.now += waiting.HEALTH_TTL_S + waiting.HEALTH_STALE_S + 0.01
    asyncio.run(g.wait())
    assert backend.asked == 2
    assert clock.slept == []
    assert hold.read_counts(tmp_path) == hold.HeldCounts(0, 0, 0)


def test_a_request_does_not_wait_for_the_probe_when_the_runtime_served_a_moment_ago(
    tmp_path: Path,
) -> None:
    """Past HEALTH_TTL_S and within HEALTH_STALE_S, /health is asked beside the request; its
    answer is for the requests after. An unhealthy answer holds them."""

    class Answers(Backend):
        def __init__(self) -> None:
            super().__init__()
            self.answer: asyncio.Future[bool] | None = None

        async def __call__(self) -> bool:
            self.asked += 1
            if self.answer is None:
                return True
            return await self.answer

    async def scenario() -> None:
        clock, backend = Clock(), Answers()
        g = turnstile(tmp_path, backend, clock, hold_s=1)
        assert await g.wait() == 0.0 and backend.asked == 1
        clock.now += waiting.HEALTH_TTL_S + 0.01
        backend.answer = asyncio.get_running_loop().create_future()
        assert await g.wait() == 0.0, "it went on without the probe's answer"
        await asyncio.sleep(0)
        assert backend.asked == 2 and clock.slept == []
        assert await g.wait() == 0.0 and backend.asked == 2, "one probe at a time"
        backend.answer.set_result(False)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        with pytest.raises(waiting.HoldTimeout, match="the backend is not healthy"):
            await g.wait()
        assert clock.slept, "the request after the unhealthy answer was held"

    asyncio.run(scenario())


def test_a_burst_asks_the_backend_once(tmp_path: Path) -> None:
    """64 requests arriving together when the last answer has aged share one /health probe."""

    class Slow(Backend):
        async def __call__(self) -> bool:
            self.asked += 1
            await asyncio.sleep(0.01)  # an answer that takes a moment, as over a socket
            return self.healthy

    backend = Slow()
    g = turnstile(tmp_path, backend, Clock())

    async def burst() -> list[float]:
        return await asyncio.gather(*(g.wait() for _ in range(64)))

    assert asyncio.run(burst()) == [0.0] * 64
    assert backend.asked == 1


def test_a_mark_holds_requests_until_it_is_gone(tmp_path: Path) -> None:
    clock, backend = Clock(), Backend()
    g = turnstile(tmp_path, backend, clock)

    async def scenario() -> float:
        with hold.marked(tmp_path, "vllm"):
            waiter = asyncio.create_task(g.wait())
            for _ in range(5):
                await asyncio.sleep(0)  # the hook polls; the clock moves only when it sleeps
            assert not waiter.done()
            assert hold.read_counts(tmp_path).now == 1
        return await waiter

    waited = asyncio.run(scenario())
    assert 0 < waited < 10
    counts = hold.read_counts(tmp_path)
    assert (counts.now, counts.total, counts.timed_out) == (0, 1, 0)


def test_the_hold_runs_out_with_a_reason_and_a_retry_after(tmp_path: Path) -> None:
    clock, backend = Clock(), Backend()
    g = turnstile(tmp_path, backend, clock, hold_s=8)
    with hold.marked(tmp_path, "vllm"), pytest.raises(waiting.HoldTimeout) as e:
        asyncio.run(g.wait())
    assert e.value.why == "switching to vllm"
    assert e.value.waited_s == pytest.approx(8)
    assert e.value.retry_after_s == 2
    assert max(clock.slept) <= waiting.POLL_S
    assert hold.read_counts(tmp_path) == hold.HeldCounts(now=0, total=1, timed_out=1)


def test_a_shorter_limit_ends_the_wait_sooner_and_never_a_longer_one(tmp_path: Path) -> None:
    """The door's wait for a runtime that died: what is left of the request's hold time."""
    clock, backend = Clock(), Backend(healthy=False)
    g = turnstile(tmp_path, backend, clock, hold_s=8)
    with pytest.raises(waiting.HoldTimeout) as e:
        asyncio.run(g.wait(limit_s=3))
    assert e.value.waited_s == pytest.approx(3)
    with pytest.raises(waiting.HoldTimeout) as e:
        asyncio.run(g.wait(limit_s=100))
    assert e.value.waited_s == pytest.approx(8)


def test_the_switch_own_token_passes_the_hold_and_a_wrong_one_does_not(tmp_path: Path) -> None:
    clock, backend = Clock(), Backend(healthy=False)
    g = turnstile(tmp_path, backend, clock, hold_s=1)
    with hold.marked(tmp_path, "vllm") as mark:
        assert asyncio.run(g.wait(mark.token)) == 0.0
        assert backend.asked == 0, "the switch verifies the runtime itself"
        with pytest.raises(waiting.HoldTimeout):
            asyncio.run(g.wait("0" * 32))


def test_an_unhealthy_backend_holds_until_it_answers(tmp_path: Path) -> None:
    clock, backend = Clock(), Backend(healthy=False)
    g = turnstile(tmp_path, backend, clock, hold_s=30)

    async def scenario() -> float:
        waiter = asyncio.create_task(g.wait())
        while clock.now < 1003:
            await asyncio.sleep(0)
        backend.healthy = True
        return await waiter

    assert asyncio.run(scenario()) == pytest.approx(3, abs=waiting.POLL_S + 0.01)
    with pytest.raises(waiting.HoldTimeout, match="not healthy"):
        backend.healthy = False
        clock.now += 60
        asyncio.run(turnstile(tmp_path, backend, clock, hold_s=2).wait())


def test_a_mark_left_by_a_dead_switch_holds_nothing(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from appliance import hold\n"
        "m = hold.marked(Path(sys.argv[1]), 'vllm'); m.__enter__()\n"  # exits without cleanup
        "import os; os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    assert (tmp_path / hold.HOLD_FILE).exists()
    assert hold.read_mark(tmp_path) is None
    assert asyncio.run(turnstile(tmp_path, Backend(), Clock()).wait()) == 0.0


def test_held_counts_of_a_worker_that_is_gone_are_dropped(tmp_path: Path) -> None:
    (tmp_path / hold.HELD_DIR).mkdir()
    (tmp_path / hold.HELD_DIR / "999999999.json").write_text(
        '{"now": 3, "total": 9, "timed_out": 1, "pid_start": "1"}'
    )
    (tmp_path / hold.HELD_DIR / "notes.txt").write_text("not a worker")
    assert hold.read_counts(tmp_path) == hold.HeldCounts()
    hold.write_counts(tmp_path, hold.HeldCounts(1, 2, 0), first=True)
    assert hold.read_counts(tmp_path) == hold.HeldCounts(1, 2, 0)
    assert not (tmp_path / hold.HELD_DIR / "999999999.json").exists()


def test_requests_let_through_are_counted_open_until_answered_and_not_while_held(
    tmp_path: Path,
) -> None:
    """The drain's count: a request is open from the moment the turnstile lets it through until the
    door closes its ticket; one that waits at the hold is not open while it waits."""
    clock, backend = Clock(), Backend()
    g = turnstile(tmp_path, backend, clock, hold_s=5)
    assert hold.read_open(tmp_path) is None, "no count before the proxy counted anything"

    async def requests() -> None:
        first, second = hold.Ticket(), hold.Ticket()
        hold.TICKET.set(first)
        await g.wait()
        assert hold.read_open(tmp_path) == 1
        with hold.marked(tmp_path, "vllm"):
            hold.TICKET.set(second)
            waiting = asyncio.create_task(g.wait())
            await asyncio.sleep(0)
            assert hold.read_open(tmp_path) == 1, "a held request is not open"
            first.close()
            assert hold.read_open(tmp_path) == 0, "drained: the switch may stop the runtime"
        await waiting
        assert hold.read_open(tmp_path) == 1
        second.close()
        second.close()  # closing twice counts once
        assert hold.read_open(tmp_path) == 0

    asyncio.run(requests())


def test_open_counts_of_a_worker_that_is_gone_are_dropped(tmp_path: Path) -> None:
    code = (
        "import os, sys; from pathlib import Path; from appliance import hold\n"
        "counts = hold.OpenRequests(Path(sys.argv[1])); counts.add(+3)\n"
        "print(hold.read_open(Path(sys.argv[1])), flush=True); os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, text=True,
                         capture_output=True).stdout  # fmt: skip
    assert out.strip() == "3", "counted while the worker lived"
    assert hold.read_open(tmp_path) == 0, "its slot is not locked any more: not counted"
    here = hold.OpenRequests(tmp_path)
    here.add(+2)
    assert hold.read_open(tmp_path) == 2, "a new worker takes a free slot from zero"


def test_the_fast_way_is_held_by_a_mark_but_never_waits_for_a_probe(tmp_path: Path) -> None:
    """The door's fast way learns from its own connection whether the runtime serves."""
    clock, backend = Clock(), Backend(healthy=False)
    g = turnstile(tmp_path, backend, clock, hold_s=1)
    assert asyncio.run(g.wait(health=False)) == 0.0 and backend.asked == 0
    with hold.marked(tmp_path, "vllm"), pytest.raises(waiting.HoldTimeout, match="to vllm"):
        asyncio.run(g.wait(health=False))
    assert backend.asked == 0 and clock.slept


def test_the_first_look_passes_at_once_counted_open_or_says_the_request_must_wait(
    tmp_path: Path,
) -> None:
    """The fast way's first look (`pass_now`), which does not leave the request's task: without a
    mark it passes, its ticket counted open before the mark was read; under a mark it does not,
    and its ticket is not left open (the drain would wait for it)."""
    clock, backend = Clock(), Backend(healthy=False)
    g = turnstile(tmp_path, backend, clock, hold_s=1)
    ticket = hold.Ticket()
    hold.TICKET.set(ticket)
    try:
        assert g.pass_now(None) and hold.read_open(tmp_path) == 1 and backend.asked == 0
        ticket.close()
        with hold.marked(tmp_path, "vllm") as mark:
            assert not g.pass_now(None) and hold.read_open(tmp_path) == 0
            assert g.pass_now(mark.token)  # the switch's own request
            ticket.close()
    finally:
        hold.TICKET.set(None)


def test_a_switch_holds_only_the_ports_it_names_and_each_port_counts_its_own(
    tmp_path: Path,
) -> None:
    """Runtimes side by side: a switch of the one on port 8001 holds its requests and drains
    its count, while requests to the runtime on port 8002 go on and are counted apart."""
    clock = Clock()
    switched = waiting.Turnstile(tmp_path, Backend(), 5, clock=clock, sleep=clock.sleep, port=8001)
    beside = waiting.Turnstile(tmp_path, Backend(), 5, clock=clock, sleep=clock.sleep, port=8002)

    async def requests() -> None:
        hold.TICKET.set(going := hold.Ticket("vision"))
        with hold.marked(tmp_path, "tp", ports=(8001,)):
            assert await beside.wait() == 0.0, "not held: its runtime is not being switched"
            hold.TICKET.set(hold.Ticket("tp"))
            with pytest.raises(waiting.HoldTimeout, match="switching to tp"):
                await switched.wait()
        assert hold.read_open(tmp_path, 8002) == 1 and hold.read_open(tmp_path, 8001) == 0
        going.close()
        assert hold.read_open(tmp_path, 8002) == 0

    asyncio.run(requests())
    mark = hold.Mark(1, "tp", 0.0, "t", ports=(8001,))
    assert mark.holds(8001) and not mark.holds(8002) and hold.Mark(1, "tp", 0.0, "t").holds(8002)


def test_a_new_file_beside_is_ours_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """create_beside never opens a file that exists: a drawn name that is taken is drawn again."""
    target = tmp_path / "mark.json"
    draws = iter([b"\x01" * 6, b"\x01" * 6, b"\x02" * 6])
    monkeypatch.setattr(hold.os, "urandom", lambda n: next(draws))
    fd, first = hold.create_beside(target)
    os.close(fd)
    fd, second = hold.create_beside(target)  # the first name is taken: the third draw
    os.close(fd)
    assert Path(first).name == ".mark.json." + "01" * 6
    assert Path(second).name == ".mark.json." + "02" * 6
    assert Path(first).parent == tmp_path and (Path(second).stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("kind", ["garbage", "folder"])
def test_a_mark_that_cannot_be_read_holds_and_says_so_once(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "no switch": a mark that exists and cannot be read holds every request (the switch's
    own too, whose token it cannot know), and the journal says why, once."""
    path = tmp_path / hold.HOLD_FILE
    if kind == "garbage":
        path.write_text('{"pid": "twelve"')
    else:
        path.mkdir()  # read_text fails with an OSError
    mark = hold.read_mark(tmp_path)
    assert mark is not None and mark.problem is not None and str(path) in mark.problem
    assert mark.holds(8001) and not waiting.is_switch_token("anything", mark)
    clock, backend = Clock(), Backend()
    for _ in range(2):
        with pytest.raises(waiting.HoldTimeout) as e:
            asyncio.run(turnstile(tmp_path, backend, clock, hold_s=1).wait())
        assert e.value.why.startswith("the hold mark cannot be read")
    lines = [line for line in capsys.readouterr().err.splitlines() if "hold mark" in line]
    assert len(lines) == 2, "once per turnstile (each one here is a new worker's)"
    assert "requests wait as in a switch" in lines[0]


def test_counts_that_cannot_be_written_are_said_in_the_journal_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(waiting, "write_counts", full)
    clock, backend = Clock(), Backend(healthy=False)
    g = turnstile(tmp_path, backend, clock, hold_s=1)
    for _ in range(3):
        with pytest.raises(waiting.HoldTimeout):
            asyncio.run(g.wait())
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"cannot write the held-request counts in {tmp_path}: No space left on device; "
        "the status page and the metrics do not see them"
    ]


@pytest.mark.real  # LiteLLM's proxy is imported: 3 s on 2 cores
def test_inside_the_proxy_a_door_that_cannot_be_mounted_stops_it() -> None:
    """A LiteLLM whose proxy module has no app the door can stand in front of: the hook's import
    ends the process (status 3: gunicorn's "failed to boot") with a journal line, rather than
    let LiteLLM serve its own routes to the clients' key."""
    code = (
        "import sys, types\n"
        "server = types.ModuleType('litellm.proxy.proxy_server')\n"
        "server.app = object()\n"
        "sys.modules['litellm.proxy.proxy_server'] = server\n"
        "import appliance.proxy.hook\n"
        "print('served anyway')\n"
    )
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "served anyway" not in out.stdout
    assert "b70: the door could not be mounted: LiteLLM's proxy has no app" in out.stderr
