"""Switching on demand, without systemd: the proxy's queues per runtime port and the refusal of
a runtime that failed to start (appliance.hold, appliance.proxy.waiting), the pin, and the
monitor's runner deciding from what it observed and applying through a switch that records its
calls. The same runner switches a real appliance in tests/test_demand_real.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from appliance import hold
from appliance.config import parse
from appliance.errors import ApplianceError, ConfigError
from appliance.layout import Scope, layout
from appliance.proxy import waiting
from appliance.switch.demand import pins, queues
from appliance.switch.demand.runner import Runner
from tests.configs import TWO_NAMES
from tests.test_proxy_hold import Backend, Clock

ON_DEMAND = TWO_NAMES + "\n[switching]\non_demand = true\nbatch = 4\n"
LLAMA, VLLM = 8001, 8002  # the ports of TWO_NAMES' runtimes


def test_requests_waiting_for_a_runtime_that_does_not_serve_are_its_queue(tmp_path: Path) -> None:
    clock = Clock()
    down = waiting.Turnstile(tmp_path, Backend(healthy=False), 300, clock, clock.sleep, VLLM)

    async def scenario() -> None:
        waiters = [asyncio.create_task(down.wait()) for _ in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        got = hold.read_queues(tmp_path)
        assert list(got) == [VLLM] and got[VLLM].count == 3
        assert time.time() - 5 < got[VLLM].oldest <= time.time()
        waiters[0].cancel()  # a client that leaves leaves the queue
        await asyncio.sleep(0)
        assert hold.read_queues(tmp_path)[VLLM].count == 2
        for w in waiters[1:]:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(scenario())
    assert hold.read_queues(tmp_path) == {}
    assert hold.read_counts(tmp_path).total == 3


def test_a_refused_runtime_gets_its_queue_a_503_naming_it_at_once(tmp_path: Path) -> None:
    clock = Clock()
    down = waiting.Turnstile(tmp_path, Backend(healthy=False), 300, clock, clock.sleep, VLLM)
    why = "vllm did not become healthy within 300 s"
    refused = {"runtime": "vllm", "until": time.time() + 42, "why": why}
    hold.write_demand(tmp_path, {"refused": {str(VLLM): refused}})
    with pytest.raises(waiting.HoldTimeout) as e:
        asyncio.run(down.wait())
    assert e.value.why.startswith(f"vllm failed to start on demand ({why}); it is not tried")
    assert 40 <= e.value.retry_after_s <= 42 and e.value.waited_s < 1
    # Another port, and the same port once the refusal ends, wait as before
    assert hold.read_refused(tmp_path, LLAMA) is None
    assert hold.read_refused(tmp_path, VLLM, now=time.time() + 43) is None


def test_first_come_first_served_keeps_a_newer_request_behind_an_older_one_for_another_model(
    tmp_path: Path,
) -> None:
    clock = Clock()
    down = waiting.Turnstile(tmp_path, Backend(healthy=False), 300, clock, clock.sleep, VLLM)
    serving = waiting.Turnstile(tmp_path, Backend(), 300, clock, clock.sleep, LLAMA)

    async def scenario(fcfs: bool) -> str | None:
        hold.write_demand(tmp_path, {"fcfs": fcfs, "refused": {}})
        serving.order_read = -1e9  # read the order again now
        older = asyncio.create_task(down.wait())
        for _ in range(5):
            await asyncio.sleep(0)
        why = await serving.blocked(None, arrived=time.time())
        before = await serving.blocked(None, arrived=time.time() - 60)  # came before it
        assert before is None
        older.cancel()
        await asyncio.gather(older, return_exceptions=True)
        assert await serving.blocked(None, arrived=time.time()) is None  # it left
        return why

    assert asyncio.run(scenario(fcfs=True)) == waiting.BEHIND
    assert asyncio.run(scenario(fcfs=False)) is None  # the policy: no order across models


def test_first_come_first_served_swaps_at_once_and_needs_on_demand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    config = parse(ON_DEMAND + "fcfs = true\n", tmp_path / "appliance.toml")
    r = Runner(config, Scope.USER, print, switch=Recorder(), clock=lambda: 10_000.0)
    just_in = [{"to": "llamacpp", "ok": True, "seconds": 10.0, "at": 10_000.0 - 1}]
    decision = r.plan(["llamacpp"], {VLLM: queue(1, 0)}, {"llamacpp": 2}, None, just_in)
    assert decision is not None and decision.target == "vllm"  # no stay, no batch
    r.save()
    assert hold.read_demand(layout(Scope.USER).state_dir)["fcfs"] is True
    with pytest.raises(ConfigError, match=r"switching\.fcfs: is the order of switching on demand"):
        parse(TWO_NAMES + "\n[switching]\nfcfs = true\n", tmp_path / "appliance.toml")


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1.5d", 129600)]
)
def test_a_pin_takes_a_duration(text: str, seconds: float) -> None:
    assert pins.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "2w", "1h30m", "31d", "nan", "1e9"])
def test_a_pin_refuses_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(ApplianceError, match="is not a duration") as e:
        pins.parse_duration(text)
    assert "--pin 30m" in str(e.value.hint)


def test_a_pin_holds_until_it_ends_or_is_cleared(tmp_path: Path) -> None:
    pin = pins.write_pin(tmp_path, "vllm", 60)
    assert pins.read_pin(tmp_path) == pin and 59 < pin.left_s(time.time()) <= 60
    assert pins.read_pin(tmp_path, now=pin.until + 1) is None
    assert pins.clear_pin(tmp_path) == pin and pins.read_pin(tmp_path) is None
    (tmp_path / pins.PIN_FILE).write_text("{not json")
    assert pins.read_pin(tmp_path) is None


class Recorder:
    """apply.switch as the runner calls it: each call recorded; fails for the names in `fail`."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail = fail

    def __call__(self, config: Any, scope: Any, name: str, reason: str = "") -> Any:
        self.calls.append((name, reason))
        if name in self.fail:
            raise ApplianceError(f"{name} did not become healthy\nits journal: ...")
        return type("Result", (), {"ok": True})()


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Runner:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    config = parse(ON_DEMAND, tmp_path / "appliance.toml")
    lines: list[str] = []
    r = Runner(config, Scope.USER, lines.append, switch=Recorder(), clock=lambda: 10_000.0)
    r.lines = lines  # type: ignore[attr-defined]
    return r


def queue(count: int, waited_s: float) -> hold.Queue:
    return hold.Queue(count, 10_000.0 - waited_s)


def test_a_request_for_the_other_model_swaps_once_nothing_is_left_for_the_runtime(
    runner: Runner,
) -> None:
    vllm_waits = {VLLM: queue(1, 5)}
    came_in = [{"to": "llamacpp", "ok": True, "seconds": 10.0, "at": 10_000.0 - 15}]
    assert runner.plan(["llamacpp"], vllm_waits, {"llamacpp": 1}, None, came_in) is None
    assert runner.decision is not None and runner.decision.reason == "busy"
    own = {**vllm_waits, LLAMA: queue(2, 1)}  # newcomers for llama.cpp are served first
    assert runner.plan(["llamacpp"], own, {}, None, came_in) is None
    decision = runner.plan(["llamacpp"], vllm_waits, {}, None, came_in)
    assert decision is not None and (decision.target, decision.reason) == ("vllm", "demand")


def test_a_runtime_with_a_stay_serves_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    config = parse(ON_DEMAND + "stay_factor = 2\n", tmp_path / "appliance.toml")
    r = Runner(config, Scope.USER, print, switch=Recorder(), clock=lambda: 10_000.0)
    # llama.cpp swapped in 15 s ago (its switch took 10 s: it stays 20 s)
    came_in = [{"to": "llamacpp", "ok": True, "seconds": 10.0, "at": 10_000.0 - 15}]
    assert r.plan(["llamacpp"], {VLLM: queue(1, 5)}, {}, None, came_in) is None
    assert r.decision is not None and r.decision.reason == "stays after its swap in"
    came_in[0]["at"] = 10_000.0 - 25
    assert r.plan(["llamacpp"], {VLLM: queue(1, 5)}, {}, None, came_in) is not None


def test_a_busy_runtime_stays_for_one_request_and_swaps_for_a_batch(runner: Runner) -> None:
    long_ago = [{"to": "llamacpp", "ok": True, "seconds": 5.0, "at": 0.0}]
    busy = {"llamacpp": 2}
    assert runner.plan(["llamacpp"], {VLLM: queue(1, 5)}, busy, None, long_ago) is None
    decision = runner.plan(["llamacpp"], {VLLM: queue(4, 5)}, busy, None, long_ago)
    assert decision is not None and decision.target == "vllm"


def test_a_pin_holds_off_demand_and_a_starving_request_goes_first_without_one(
    runner: Runner,
) -> None:
    long_ago = [{"to": "llamacpp", "ok": True, "seconds": 5.0, "at": 0.0}]
    pin = pins.Pin("llamacpp", 10_000.0 + 600)
    # waited 240 s of the proxy's 300 s hold: a swap of vLLM's default 60 s ends just in time
    starving = {VLLM: queue(1, 240)}
    assert runner.plan(["llamacpp"], starving, {"llamacpp": 1}, pin, long_ago) is None
    assert runner.decision is not None and runner.decision.reason == "pinned"
    decision = runner.plan(["llamacpp"], starving, {"llamacpp": 1}, None, long_ago)
    assert decision is not None and (decision.target, decision.reason) == ("vllm", "starving")


def test_requests_for_the_serving_runtime_are_no_demand(runner: Runner) -> None:
    assert runner.plan(["llamacpp"], {LLAMA: queue(9, 200)}, {}, None, []) is None


def test_nothing_serving_starts_what_is_asked_for_at_once(runner: Runner) -> None:
    decision = runner.plan([], {VLLM: queue(1, 0)}, {}, None, [])
    assert decision is not None and decision.target == "vllm"


def test_a_failed_start_is_refused_for_the_backoff_not_tried_in_a_loop(runner: Runner) -> None:
    runner.switch = Recorder(fail=("vllm",))
    decision = runner.plan([], {VLLM: queue(3, 1)}, {}, None, [])
    assert decision is not None
    runner.apply(decision)
    state_dir = layout(Scope.USER).state_dir
    refused = hold.read_refused(state_dir, VLLM, now=10_000.0)
    assert refused is not None and refused.runtime == "vllm"
    assert refused.why == "vllm did not become healthy" and refused.until == 10_060.0
    assert any("not tried again for 60 s" in line for line in runner.lines)  # type: ignore[attr-defined]
    # The queue is still there (its requests get their 503 from the proxy): no second try
    assert runner.plan([], {VLLM: queue(3, 2)}, {}, None, []) is None
    assert runner.switch.calls == [("vllm", "demand")]  # type: ignore[attr-defined]


def test_a_switch_by_someone_else_meanwhile_is_not_a_failure(runner: Runner) -> None:
    def busy(*args: Any, **kwargs: Any) -> Any:
        raise ApplianceError("another switch is running", code="switch_in_progress")

    runner.switch = busy
    decision = runner.plan([], {VLLM: queue(1, 1)}, {}, None, [])
    assert decision is not None
    runner.apply(decision)
    assert hold.read_refused(layout(Scope.USER).state_dir, VLLM, now=10_000.0) is None


def test_an_idle_card_returns_to_the_default_runtime_when_asked_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    config = parse(ON_DEMAND + "idle_return_s = 300\n", tmp_path / "appliance.toml")
    now = [10_000.0]
    r = Runner(config, Scope.USER, print, switch=Recorder(), clock=lambda: now[0])
    came_in = [{"to": "vllm", "ok": True, "seconds": 50.0, "at": 0.0}]
    assert r.plan(["vllm"], {}, {"vllm": 1}, None, came_in) is None  # busy now
    now[0] += 299
    assert r.plan(["vllm"], {}, {}, None, came_in) is None
    now[0] += 2
    decision = r.plan(["vllm"], {}, {}, None, came_in)
    assert decision is not None and (decision.target, decision.reason) == (
        "llamacpp",
        "idle return",
    )


def test_status_shows_the_queues_by_model_the_pin_and_refusals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = parse(ON_DEMAND, tmp_path / "appliance.toml")
    clock = Clock()
    down = waiting.Turnstile(tmp_path, Backend(healthy=False), 300, clock, clock.sleep, VLLM)
    pins.write_pin(tmp_path, "llamacpp", 600)
    refused = {"runtime": "vllm", "until": time.time() + 30, "why": "it hung"}
    hold.write_demand(tmp_path, {"refused": {str(VLLM): refused}, "decision": None})

    async def scenario() -> dict[str, Any]:
        hold.write_demand(tmp_path, {"refused": {}, "decision": {"reason": "pinned"}})
        waiter = asyncio.create_task(down.wait())
        for _ in range(5):
            await asyncio.sleep(0)
        view = queues.demand_view(config, tmp_path, {"to": "llamacpp", "reason": "demand"})
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        return view

    view = asyncio.run(scenario())
    assert view["queues"] == [
        {
            "model": "big",
            "port": VLLM,
            "runtime": "vllm",
            "waiting": 1,
            "tokens": 0,
            "oldest_s": 0.0,
        }
    ]
    assert view["pin"]["runtime"] == "llamacpp" and 599 < view["pin"]["left_s"] <= 600
    assert view["decision"] == {"reason": "pinned"} and view["last_reason"] == "demand"
    hold.write_demand(tmp_path, {"refused": {str(VLLM): refused}})
    view = queues.demand_view(config, tmp_path, None)
    assert [r["runtime"] for r in view["refused"]] == ["vllm"] and view["queues"] == []
    from appliance.cli.output import _demand_lines

    text = "\n".join(_demand_lines(view))
    assert "on demand  yes" in text and "pin       llamacpp until" in text
    assert "refused   vllm for 30 s more: it failed to start on demand: it hung" in text


def test_a_swaps_cost_is_its_last_good_start_with_its_present_recipe_and_status_shows_it(
    tmp_path: Path,
) -> None:
    """The drain of what the other runtime served is not the swap's; a start that failed is no
    cost; a new recipe (install of other args) learns its cost afresh; status shows each."""
    from appliance.switch.records import read_history, recipe_of, record_switch, swap_costs

    config = parse(ON_DEMAND, tmp_path / "appliance.toml")
    vllm = recipe_of(config.runtimes["vllm"])
    record_switch(tmp_path, {"to": "vllm", "ok": True, "seconds": 50.0, "at": 1.0,
                             "phases": {"drained": 8.0}, "recipe": vllm})  # fmt: skip
    record_switch(tmp_path, {"to": "vllm", "ok": False, "seconds": 3.0, "at": 2.0, "recipe": vllm})
    record_switch(tmp_path, {"to": "llamacpp", "ok": True, "seconds": 6.0, "at": 3.0,
                             "recipe": "an older recipe"})  # fmt: skip
    history = read_history(tmp_path)
    took, since = swap_costs(history, config.runtimes)
    assert took == {"vllm": 42.0} and since == {"vllm": 1.0, "llamacpp": 3.0}
    assert len(history) == 3
    view = queues.demand_view(config, tmp_path, None)
    # records from before starts were judged cold or warm: no figure of either, nor of the next
    unjudged = {"cold_s": None, "warm_s": None, "next": None}
    assert view["costs"] == {
        "llamacpp": {
            "seconds": 10.0,
            "from": "default",
            "cold_s": None,
            "warm_s": None,
            "next": None,
        },
        "vllm": {"seconds": 42.0, "from": "records", **unjudged},
    }
    from appliance.cli.output import _demand_lines

    text = "\n".join(_demand_lines(view))
    assert "swap to   vllm takes 42 s (last switch)" in text
    assert "swap to   llamacpp takes 10 s (engine's default)" in text
    # starts judged cold and warm (docs/caches.md): the warm one is what the next swap takes
    for seconds, verdict in ((230.0, "cold"), (19.0, "warm")):
        record_switch(
            tmp_path,
            {
                "to": "vllm",
                "ok": True,
                "seconds": seconds,
                "at": 4.0,
                "recipe": vllm,
                "start": {"verdict": verdict},
            },
        )
    text = "\n".join(_demand_lines(queues.demand_view(config, tmp_path, None)))
    assert (
        "swap to   vllm takes 19 s (its cache is warm; cold 230 s, warm 19 s, last switch)" in text
    )
    other = parse(ON_DEMAND.replace('engine = "vllm"', 'engine = "vllm"\nargs = ["-tp", "2"]', 1),
                  tmp_path / "appliance.toml")  # fmt: skip
    assert recipe_of(other.runtimes["vllm"]) != vllm
    assert swap_costs(history, other.runtimes)[0] == {}


def test_purge_removes_every_file_switching_on_demand_makes(tmp_path: Path) -> None:
    from appliance.deploy.purge import purge_state

    clock = Clock()
    down = waiting.Turnstile(tmp_path, Backend(healthy=False), 300, clock, clock.sleep, VLLM)
    with pytest.raises(waiting.HoldTimeout):  # its queue file, written while it waited
        asyncio.run(down.wait(limit_s=1))
    hold.write_demand(tmp_path, {"fcfs": False, "refused": {}})
    pins.write_pin(tmp_path, "vllm", 60)
    assert any(p.name.endswith(f"-{VLLM}.json") for p in (tmp_path / hold.HELD_DIR).iterdir())
    out = purge_state(tmp_path)
    assert not tmp_path.exists() and out.kept == [] and out.failed == []  # the folder too


CARDS = """
default_runtime = "chat"
[gpu]
cards = "auto"
[runtimes.chat]
engine = "vllm"
model = "/m"
cards = [0]
[runtimes.vision]
engine = "llamacpp"
command = ["/usr/bin/true"]
model = "/m.gguf"
cards = [1]
served_model_name = "vision"
port = 8002
[runtimes.long]
engine = "llamacpp"
command = ["/usr/bin/true"]
model = "/m.gguf"
cards = [1]
served_model_name = "long"
port = 8003
[switching]
on_demand = true
"""


def test_on_several_cards_only_what_shares_a_card_with_the_target_is_weighed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """chat serves on card 0, vision on card 1; a request for long (card 1) is weighed against
    vision alone: chat's requests in flight do not keep it waiting, and a switch to long
    stops vision only (the switch's plan, tests/test_plans.py)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    config = parse(CARDS, tmp_path / "appliance.toml")
    r = Runner(config, Scope.USER, print, switch=Recorder(), clock=lambda: 10_000.0)
    long_ago = [{"to": name, "ok": True, "seconds": 5.0, "at": 0.0} for name in ("chat", "vision")]
    busy_chat = {"chat": 5, "vision": 0}
    decision = r.plan(["chat", "vision"], {8003: queue(1, 1)}, busy_chat, None, long_ago)
    assert decision is not None and decision.target == "long"
    busy_vision = {"chat": 0, "vision": 2}
    assert r.plan(["chat", "vision"], {8003: queue(1, 1)}, busy_vision, None, long_ago) is None
    assert r.decision is not None and r.decision.reason == "busy"
    # with vision stopped, card 1 is free: long starts at once, whatever chat does
    decision = r.plan(["chat"], {8003: queue(1, 0)}, busy_chat, None, [])
    assert decision is not None and (decision.target, decision.reason) == ("long", "demand")


def test_the_queue_counts_the_tokens_its_requests_ask_for_and_more_of_them_goes_first(
    tmp_path: Path,
) -> None:
    from appliance.switch.demand.policy import Card, Policy, Waiting, decide

    clock = Clock()
    down = waiting.Turnstile(tmp_path, Backend(healthy=False), 300, clock, clock.sleep, VLLM)

    async def asking(tokens: int) -> float:
        ticket = hold.Ticket("big")
        ticket.tokens = tokens
        hold.TICKET.set(ticket)  # this task's own, as the door sets it for each request
        return await down.wait()

    async def scenario() -> hold.Queue:
        waiters = [asyncio.create_task(asking(n)) for n in (100, 300)]
        for _ in range(5):
            await asyncio.sleep(0)
        got = hold.read_queues(tmp_path)[VLLM]
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        return got

    assert asyncio.run(scenario()).tokens == 400
    few, many = Waiting("llamacpp", 2, 5.0, 20), Waiting("vllm", 2, 5.0, 400)
    assert decide(Card(None), [few, many], {}, Policy()).target == "vllm"
