"""The switch's executor (appliance.switch.executor.Executor) on edges that record what they are asked
and a clock that only the edges move: every plan of appliance.switch.plans, applied, with each failing
step, without systemd. tests/test_switch_real.py runs the same executor on the real edges."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from appliance.errors import ApplianceError
from appliance.hold import Mark
from appliance.switch import plans
from appliance.switch.executor import Executor
from appliance.switch.interrupts import Interrupts, SwitchInterrupted

TOKEN = "t0ken"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now


class Edges:
    """Records each call as one line; `fail` makes the call of that line raise, `seconds`
    makes it take that long on the clock, `then` runs after it."""

    def __init__(self, clock: Clock, **options: Any) -> None:
        self.clock = clock
        self.calls: list[str] = []
        self.records: list[dict[str, Any]] = []
        self.fail: set[str] = set(options.get("fail", ()))
        self.seconds: dict[str, float] = options.get("seconds", {})
        self.then: dict[str, Callable[[], None]] = options.get("then", {})
        self.left: int | None = options.get("left", 0)
        self.unrecorded: str | None = options.get("unrecorded")
        self.journal_text: str = options.get("journal", "line 1\nline 2")
        self.start_found: dict[str, Any] | None = options.get("start_cache")

    def call(self, line: str) -> None:
        self.calls.append(line)
        self.clock.now += self.seconds.get(line, 0.0)
        if line in self.then:
            self.then[line]()
        if line in self.fail:
            raise ApplianceError(f"{line} failed", code="test")

    @contextmanager
    def hold(self, target: str, stopping: tuple[str, ...]) -> Iterator[Mark]:
        self.call(f"hold {target}")
        self.held_with = stopping
        try:
            yield Mark(1, target, 0.0, TOKEN)
        finally:
            self.calls.append("release")

    def note(self, **fields: Any) -> None:
        self.calls.append(f"note {fields['phase']}")

    def drain(self, runtime: str, timeout_s: float, stop: Callable[[], bool]) -> int | None:
        self.call(f"drain {runtime} {timeout_s:g}")
        return self.left

    def stop(self, runtime: str, wait: bool) -> None:
        self.call(f"stop {runtime}" + (" and wait" if wait else ""))

    def start(self, runtime: str) -> dict[str, float]:
        self.call(f"start {runtime}")
        return {"start-pre": 1.0, "start-post": 2.0}

    def verify(self, runtime: str, token: str | None) -> str:
        self.call(f"verify {runtime}" + (" past the hold" if token == TOKEN else ""))
        return f"{runtime} ready"

    def gate(self, runtime: str, token: str | None) -> None:
        self.call(f"gate {runtime}")

    def enable(self, runtime: str) -> None:
        self.call(f"enable {runtime}")

    def journal(self, runtime: str, since: float | None) -> str | None:
        self.calls.append(f"journal {runtime}")
        return self.journal_text

    def start_cache(self, runtime: str, since: float | None) -> dict[str, Any] | None:
        return self.start_found

    def journal_command(self, runtime: str) -> str:
        return f"journalctl -u b70-{runtime}.service"

    def record(self, record: dict[str, Any]) -> str | None:
        self.records.append(record)
        return self.unrecorded


def execute(
    previous: str | None, target: str, options: plans.Options | None = None, **edges: Any
) -> tuple[Edges, Any]:
    """Plan and apply one switch; what the edges saw, and its result or error."""
    clock = Clock()
    fake = Edges(clock, **edges)
    shown: list[tuple[str, str]] = []
    interrupts = Interrupts(lambda phase, detail: shown.append((phase, detail)))
    run = Executor(fake, clock, interrupts, target, previous, 8000, clock.monotonic())
    plan = plans.plan_switch(
        plans.Observed((previous,) if previous else ()), target, options or plans.Options()
    )
    try:
        outcome: Any = run.run(plan)
    except ApplianceError as e:
        outcome = e
    return fake, outcome


SWITCHED = [
    "hold vllm", "note hold", "note drain", "drain llamacpp 60", "note start", "start vllm",
    "note verify", "verify vllm past the hold", "release", "enable vllm",
]  # fmt: skip


def test_a_switch_holds_drains_starts_verifies_then_releases_before_it_enables() -> None:
    seconds = {"start vllm": 7.0, "drain llamacpp 60": 0.5}
    fake, result = execute("llamacpp", "vllm", seconds=seconds)
    assert fake.calls == SWITCHED
    assert result.ok and result.answer == "vllm ready" and not result.rolled_back
    assert result.phases == {
        "drained": 0.5, "waiting for the GPU and the port": 1.0, "loading": 2.0, "unit": 7.0,
        "verified": 0.0,
    }  # fmt: skip
    assert result.seconds == 7.5
    assert [(r["from"], r["to"], r["ok"], r["interrupted"]) for r in fake.records] == [
        ("llamacpp", "vllm", True, False)
    ]


def test_already_serving_verifies_and_enables_and_records_nothing() -> None:
    fake, result = execute("vllm", "vllm")
    assert fake.calls == ["verify vllm", "enable vllm"]
    assert result.ok and "vllm is already serving" in result.notes
    assert fake.records == []


def test_a_restart_stops_the_unit_and_waits_before_it_starts_it() -> None:
    fake, result = execute("vllm", "vllm", plans.Options(restart=True))
    assert fake.calls == [
        "hold vllm", "note hold", "note drain", "drain vllm 60", "note start", "stop vllm and wait",
        "start vllm", "note verify", "verify vllm past the hold", "release", "enable vllm",
    ]  # fmt: skip
    assert result.ok


def test_from_nothing_there_is_no_drain() -> None:
    fake, result = execute(None, "vllm")
    assert "note drain" not in fake.calls and fake.calls[-1] == "enable vllm"
    assert result.ok


def test_the_gate_runs_past_the_hold_after_the_verification() -> None:
    fake, result = execute("llamacpp", "vllm", plans.Options(gate=True))
    i = fake.calls.index("verify vllm past the hold")
    assert fake.calls[i + 1 : i + 3] == ["note gate", "gate vllm"]
    assert result.ok and "gated" in result.phases


ROLLED_BACK_AFTER = [
    ("start vllm", plans.Options()),
    ("verify vllm past the hold", plans.Options()),
    ("gate vllm", plans.Options(gate=True)),
]


@pytest.mark.parametrize(("failing", "options"), ROLLED_BACK_AFTER)
def test_a_failing_start_verify_or_gate_rolls_back_while_held(
    failing: str, options: plans.Options
) -> None:
    fake, error = execute("llamacpp", "vllm", options, fail={failing})
    assert isinstance(error, ApplianceError) and error.code == "switch_failed"
    after = fake.calls[fake.calls.index(failing) + 1 :]
    assert after == [
        "note rollback", "journal vllm", "start llamacpp", "verify llamacpp past the hold",
        "release",
    ]  # fmt: skip
    assert f"switch to vllm failed: {failing} failed" in error.message
    assert "last lines of b70-vllm.service:\n    line 1\n    line 2" in error.message
    assert "rolled back: llamacpp is serving again" in error.message
    assert error.hint == "journal: journalctl -u b70-vllm.service"
    (record,) = fake.records
    assert record["ok"] is False and record["rolled_back"] is True
    assert error.details["switch"]["error"] == record["error"]


def test_a_rollback_from_nothing_stops_the_target_without_waiting() -> None:
    fake, error = execute(None, "vllm", fail={"start vllm"})
    assert fake.calls[-3:] == ["journal vllm", "stop vllm", "release"]
    assert "no runtime was serving before, so none is serving now" in error.message
    assert fake.records[0]["rolled_back"] is False


def test_a_switch_over_two_runtimes_holds_drains_and_brings_back_both() -> None:
    """Runtimes side by side: the target needs the cards of two serving runtimes. Both are held
    and drained; a failed start brings both back, each verified, and the one on other cards is
    not touched."""
    clock = Clock()
    fake = Edges(clock, fail={"start wide"})
    interrupts = Interrupts(lambda phase, detail: None)
    cards = {"a": frozenset({0}), "b": frozenset({1}), "far": frozenset({5}),
             "wide": frozenset({0, 1})}  # fmt: skip
    plan = plans.plan_switch(plans.Observed(("a", "b", "far"), cards), "wide", plans.Options())
    run = Executor(fake, clock, interrupts, "wide", "a, b", 8000, 0.0)
    with pytest.raises(ApplianceError) as error:
        run.run(plan)
    assert fake.held_with == ("a", "b")
    assert [c for c in fake.calls if c.split()[0] in ("drain", "start", "verify")] == [
        "drain a 60", "drain b 60", "start wide", "start a", "verify a past the hold",
        "start b", "verify b past the hold",
    ]  # fmt: skip
    assert not any("far" in c for c in fake.calls)
    assert "rolled back: a, b are serving again" in error.value.message


def test_the_runtimes_a_switch_stops_drain_within_one_limit() -> None:
    """Their requests were all let through before the hold, so they drain at once: a second
    drain gets what is left of the limit, not a limit of its own."""
    clock = Clock()
    fake = Edges(clock, seconds={"drain a 60": 45.0})
    cards = {"a": frozenset({0}), "b": frozenset({1}), "wide": frozenset({0, 1})}
    plan = plans.plan_switch(plans.Observed(("a", "b"), cards), "wide", plans.Options())
    interrupts = Interrupts(lambda phase, detail: None)
    result = Executor(fake, clock, interrupts, "wide", "a, b", 8000, 0.0).run(plan)
    assert [c for c in fake.calls if c.startswith("drain")] == ["drain a 60", "drain b 15"]
    assert result.ok and result.phases["drained"] == 45.0


def test_a_rollback_that_fails_says_so() -> None:
    fake, error = execute("llamacpp", "vllm", fail={"start vllm", "start llamacpp"})
    assert "rolling back to llamacpp failed as well: start llamacpp failed" in error.message
    assert fake.records[0]["rolled_back"] is False
    assert fake.calls[-1] == "release"


@pytest.mark.parametrize("failing", ["hold vllm", "drain llamacpp 60"])
def test_a_failure_before_the_commit_changes_nothing_and_is_not_rolled_back(failing: str) -> None:
    fake, error = execute("llamacpp", "vllm", fail={failing})
    assert error.message == f"{failing} failed"
    assert not any(c.startswith(("start", "stop", "enable")) for c in fake.calls)
    assert fake.records == []


def test_the_drain_notes_what_was_left_in_flight_or_not_reported() -> None:
    _, result = execute("llamacpp", "vllm", left=3)
    assert any("3 request(s) still in flight after 60 s" in n for n in result.notes)
    _, result = execute("llamacpp", "vllm", left=None)
    assert "drain: llamacpp did not report its requests in flight" in result.notes


def test_a_signal_during_the_drain_stops_there_and_records_it() -> None:
    box: dict[str, Executor] = {}

    def signal() -> None:
        box["run"].interrupts._received = "SIGTERM"

    clock = Clock()
    fake = Edges(clock, then={"drain llamacpp 60": signal})
    interrupts = Interrupts(lambda phase, detail: None)
    run = box["run"] = Executor(fake, clock, interrupts, "vllm", "llamacpp", 8000, 0.0)
    with pytest.raises(SwitchInterrupted) as e:
        run.run(plans.plan_switch(plans.Observed(("llamacpp",)), "vllm", plans.Options()))
    assert "during the drain" in e.value.message and "nothing was changed" in e.value.message
    assert not any(c.startswith(("start", "enable")) for c in fake.calls)
    assert fake.calls[-1] == "release"
    assert fake.records[0]["interrupted"] is True and fake.records[0]["ok"] is False


def test_a_signal_after_the_commit_finishes_the_switch_then_says_so() -> None:
    clock = Clock()
    interrupts = Interrupts(lambda phase, detail: None)

    def signal() -> None:
        interrupts._received = "SIGINT"

    fake = Edges(clock, then={"start vllm": signal})
    run = Executor(fake, clock, interrupts, "vllm", "llamacpp", 8000, 0.0)
    with pytest.raises(SwitchInterrupted) as e:
        run.run(plans.plan_switch(plans.Observed(("llamacpp",)), "vllm", plans.Options()))
    assert e.value.recorded and "vllm is serving" in e.value.message
    assert fake.calls == SWITCHED
    assert fake.records[0]["ok"] is True and fake.records[0]["interrupted"] is True


def test_a_record_that_cannot_be_written_is_said_not_lost() -> None:
    _, result = execute("llamacpp", "vllm", unrecorded="state dir full")
    assert result.ok and "state dir full" in result.notes
    _, error = execute("llamacpp", "vllm", fail={"start vllm"}, unrecorded="state dir full")
    assert error.message.endswith("\nstate dir full")


def test_a_target_that_cannot_be_enabled_serves_and_the_switch_says_so_and_records_it() -> None:
    """Verified and serving: no rollback, but boot would start another runtime, so the command
    fails with that, and the history has the switch with the reason."""
    fake, error = execute("llamacpp", "vllm", fail={"enable vllm"})
    assert fake.calls == SWITCHED, "nothing is rolled back or stopped"
    assert isinstance(error, ApplianceError) and error.code == "enable_failed"
    assert error.message == "vllm serves, but could not be enabled for boot: enable vllm failed"
    assert "`b70ctl switch vllm`" in (error.hint or "")
    [record] = fake.records
    assert record["ok"] is True and record["to"] == "vllm"
    assert record["error"] == error.message
