"""The switch on demand, applied: a thread of `b70ctl monitor` that looks twice a second at the
requests waiting at the proxy for a runtime port whose runtime does not serve, asks the policy
(appliance.switch.demand.policy) what each card should serve, and switches through the same
switch as `b70ctl switch` (lock, hold, drain, one StartUnit, verify, rollback).

- One switch at a time: a look while any switch runs (by hand, failover, on demand) does
  nothing, so a flood of requests for the other model during a swap starts no second one.
- A runtime that fails to start is refused for [switching] backoff_s: the requests waiting for
  it get a 503 naming it at once (appliance.proxy.waiting reads the refusal), and it is not
  tried again until the backoff ends, whatever waits.
- What a swap costs is each runtime's last switch time in the records (policy.cost_of).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from appliance import hold
from appliance.config import Config, RuntimeConfig
from appliance.errors import ApplianceError, from_exception
from appliance.host.placement import excludes
from appliance.layout import HISTORY, Scope, layout
from appliance.switch import apply
from appliance.switch.demand.pins import Pin, read_pin
from appliance.switch.demand.policy import DEMAND, Card, Decision, Policy, Waiting, cost_of, decide
from appliance.switch.demand.queues import target_of
from appliance.switch.lock import switch_running
from appliance.switch.records import read_history, swap_costs
from appliance.units import systemd
from appliance.units.serving import serving_runtimes

LOOK_S = 0.5
SwitchFn = Callable[..., Any]  # apply.switch's signature: (config, scope, name, reason=...)


def policy_of(config: Config) -> Policy:
    """The config's order; with `fcfs` the proxy also keeps the requests behind one for another
    runtime waiting (appliance.proxy.waiting)."""
    s = config.switching
    default = config.default_runtime if config.default_runtime in config.runtimes else None
    return Policy(
        s.max_wait_s, s.stay_factor, s.batch, s.idle_return_s, default, s.order,
        hold_s=config.proxy.hold_s,
    )  # fmt: skip


class Runner:
    """What one look decides (`plan`, from what was observed) and applies (`step`)."""

    def __init__(
        self,
        config: Config,
        scope: Scope,
        log: Callable[[str], None],
        switch: SwitchFn = apply.switch,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config, self.scope, self.log = config, scope, log
        self.state_dir: Path = layout(scope).state_dir
        self.switch, self.clock = switch, clock
        self.policy = policy_of(config)
        self.first_seen: dict[str, float] = {}  # when each serving runtime was first seen serving
        self.busy_at: dict[str, float] = {}  # when each last had a request in flight
        self.refused: dict[int, dict[str, Any]] = {}  # port -> {runtime, until, why}
        self.decision: Decision | None = None  # the last look's
        self.written: str | None = None
        self.history_key: tuple[int, int] | None = None
        self.history: list[dict[str, Any]] = []

    def rt(self, name: str) -> RuntimeConfig:
        return self.config.runtimes[name]

    # --- deciding ---------------------------------------------------------------------------

    def plan(
        self,
        serving: Sequence[str],
        queues: Mapping[int, hold.Queue],
        in_flight: Mapping[str, int],
        pin: Pin | None,
        history: Sequence[Mapping[str, Any]],
    ) -> Decision | None:
        """The switch to make now, if any (one per look), from what was observed."""
        now = self.clock()
        for name in list(self.first_seen):
            if name not in serving:
                del self.first_seen[name]
        for name in serving:
            self.first_seen.setdefault(name, now)
            if in_flight.get(name, 0) > 0:
                self.busy_at[name] = now
        costs, since = self.costs(history)
        wants, own = self.wants(serving, queues, now)
        looks: list[Decision] = []
        for target in sorted(wants, key=lambda t: -wants[t].count):
            blockers = [s for s in serving if excludes(self.rt(target), self.rt(s))]
            if not blockers:
                return Decision(target, DEMAND)  # its cards are free: it starts at once
            card = self.card(blockers, in_flight, pin, since, now)
            here = self.rt(str(card.serving))
            waiting = [w for t, w in wants.items() if excludes(self.rt(t), here)]
            waiting += [own[s] for s in blockers if s in own]
            decision = decide(card, waiting, costs, self.policy)
            if decision.target is not None:
                return decision
            looks.append(decision)
        back = self.policy.default_runtime
        if not wants and back is not None and back not in serving and self.policy.idle_return_s:
            blockers = [s for s in serving if excludes(self.rt(back), self.rt(s))]
            if blockers:
                card = self.card(blockers, in_flight, pin, since, now)
                decision = decide(card, [], costs, self.policy)
                if decision.target is not None:
                    return decision
                looks.append(decision)
        self.decision = looks[0] if looks else None
        return None

    def costs(
        self, history: Sequence[Mapping[str, Any]]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Each runtime's swap cost (records.swap_costs, else its engine's default) and when its
        last switch in ended (epoch seconds)."""
        took, since = swap_costs(history, self.config.runtimes)
        costs = {
            name: cost_of(name, rt.engine.value, took) for name, rt in self.config.runtimes.items()
        }
        return costs, since

    def wants(
        self, serving: Sequence[str], queues: Mapping[int, hold.Queue], now: float
    ) -> tuple[dict[str, Waiting], dict[str, Waiting]]:
        """The queues for runtimes that do not serve (by the runtime they bring up), and those
        for runtimes that serve (waiting for a moment of health, or a switch's hold)."""
        on_port = {self.rt(s).port: s for s in serving}
        wants: dict[str, Waiting] = {}
        own: dict[str, Waiting] = {}
        for port, queue in sorted(queues.items()):
            waited = max(0.0, now - queue.oldest)
            if port in on_port:
                own[on_port[port]] = Waiting(on_port[port], queue.count, waited, queue.tokens)
                continue
            target = target_of(self.config, port)
            refused = self.refused.get(port)
            if target is None or (refused is not None and refused["until"] > now):
                continue
            wants[target] = Waiting(target, queue.count, waited, queue.tokens)
        return wants, own

    def card(
        self,
        blockers: Sequence[str],
        in_flight: Mapping[str, int],
        pin: Pin | None,
        since: Mapping[str, float],
        now: float,
    ) -> Card:
        """What serves where a target would start: the runtime that came in last among those it
        would stop, with the requests in flight of all of them."""

        def came_in(name: str) -> float:
            return since[name] if name in since else self.first_seen.get(name, now)

        serving = max(blockers, key=came_in)
        busy = max((self.busy_at.get(s, came_in(s)) for s in blockers), default=now)
        return Card(
            serving=serving,
            since_s=max(0.0, now - min(came_in(serving), now)),
            in_flight=sum(in_flight.get(s, 0) for s in blockers),
            idle_s=max(0.0, now - busy),
            pinned_s=pin.left_s(now) if pin is not None and pin.runtime in blockers else 0.0,
        )

    # --- applying ---------------------------------------------------------------------------

    def step(self, sd: systemd.Systemd) -> Decision | None:
        """One look: observe, decide, switch if the policy says so, save the record."""
        if switch_running(self.state_dir):
            return None
        serving = serving_runtimes(self.config, sd)
        queues = hold.read_queues(self.state_dir)
        in_flight = {s: hold.read_open(self.state_dir, self.rt(s).port) or 0 for s in serving}
        decision = self.plan(serving, queues, in_flight, read_pin(self.state_dir), self.records())
        if decision is not None and decision.target is not None:
            self.apply(decision)
        self.save()
        return decision

    def apply(self, decision: Decision) -> None:
        target = str(decision.target)
        self.decision = decision
        self.log(f"on demand: switching to {target} ({decision.reason})")
        try:
            result = self.switch(self.config, self.scope, target, reason=decision.reason)
        except ApplianceError as e:
            if e.code == "switch_in_progress":
                return  # another switch began meanwhile: the next look sees what it did
            self.refuse(target, e.message)
            return
        if not getattr(result, "ok", True):
            self.refuse(target, str(getattr(result, "error", None) or "the switch failed"))

    def refuse(self, target: str, why: str) -> None:
        backoff = self.config.switching.backoff_s
        line = why.strip().splitlines()[0] if why.strip() else "the switch failed"
        self.refused[self.rt(target).port] = {
            "runtime": target, "until": self.clock() + backoff, "why": line,
        }  # fmt: skip
        self.log(f"on demand: {target} failed to start: {line}; not tried again for {backoff:g} s")
        self.save()

    def records(self) -> list[dict[str, Any]]:
        """The switch history, read again only when it changed."""
        try:
            st = (self.state_dir / HISTORY).stat()
            key = (st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if key != self.history_key:
            self.history, self.history_key = read_history(self.state_dir), key
        return self.history

    def save(self) -> None:
        """The record the proxy (refusals) and `status` (the last look's reason) read; written
        when it changes."""
        now = self.clock()
        self.refused = {port: r for port, r in self.refused.items() if r["until"] > now}
        d = self.decision
        doc: dict[str, object] = {
            "fcfs": self.config.switching.fcfs,  # the proxy keeps the order of arrival
            "refused": {str(port): r for port, r in sorted(self.refused.items())},
            "decision": None if d is None else {"target": d.target, "reason": d.reason},
        }
        text = repr(doc)
        if text != self.written:
            hold.write_demand(self.state_dir, doc)
            self.written = text

    def run(self) -> None:
        """Look every LOOK_S until the process ends; a look that fails is logged once while its
        problem lasts, and the next one tries again."""
        trouble: str | None = None
        while True:
            try:
                with systemd.connect(self.scope) as sd:
                    while True:
                        self.step(sd)
                        if trouble is not None:
                            self.log("on demand: looks succeed again")
                            trouble = None
                        time.sleep(LOOK_S)
            except Exception as e:  # the thread must outlive any one look: said, not raised
                problem = (
                    str(from_exception(e).message)
                    if isinstance(e, ApplianceError | OSError)
                    else f"{type(e).__name__}: {e}"
                )
                if problem != trouble:
                    self.log(f"on demand: this look failed: {problem}; looking again")
                trouble = problem
                time.sleep(LOOK_S * 4)
