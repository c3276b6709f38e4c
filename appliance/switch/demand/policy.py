"""Switch on demand (`[switching] on_demand`): which runtime a card should serve next, when
requests wait at the proxy for a model whose runtime does not serve. A pure function of what was
observed (the queues, what serves and since when, what each swap costs) and the order; the
proxy's queue and the switch that applies a decision are elsewhere.

What a swap costs is the runtime's switch time, from its records (a default by engine before its
first): about 5 s for llama.cpp and 35-55 s for vLLM on the demo's CPU, minutes for vLLM on a
B70. Three orders (`[switching] order`):

- `fcfs`, strict first come, first served (llama-swap's order before its queue collated,
  llama.cpp's router without its queue): a request for another runtime swaps as soon as those
  in flight end, and the proxy keeps every newer request behind it, whichever model it asks for.
- `collated`, first come, first served as llama-swap serves now: the runtime that swapped in
  takes every request waiting for it, newcomers too, and swaps away only when none is left
  waiting or in flight, to the runtime of the oldest request waiting for another.
- `policy` (the default): the collated order, and what it lacks. A request goes first, even
  while the serving runtime still has work, when the proxy's hold would otherwise end before
  its swap did (it would be answered 503), or, with `max_wait_s`, once it has waited that
  long. Its waiting counts from when it could have been served, that is not before the
  serving runtime's swap in ended, and the runtime that swapped in first serves every request
  that was waiting for it then. So a swap that costs more than `max_wait_s` is no reason to
  swap straight back, and no swap is undone before it served. `stay_factor` (a runtime serves
  at least that many times its swap's cost) and `batch` (that many requests waiting for
  another swap a busy runtime out) trade latency for fewer swaps; both are off by default.

In every order:
1. Pinned: a runtime pinned by hand (`b70ctl switch NAME --pin`) serves until the pin ends.
2. Nothing serves: the runtime of the oldest waiting request starts at once.
3. Idle return: with `idle_return_s`, a card idle that long with no queue goes back to its
   default runtime.

Why the collated order at heart: on simulated hours of two models' traffic
(b70tools.demand_sim, at the demo's swap costs and a B70's), every rule tried that knows what a
swap costs (stay a multiple of it, wait for a batch, linger after the queue empties, swap for a
request waiting 120 s) swapped less but made one model's p95 latency 1.1 to 4 times the
collated order's (docs/switch.md has the tables). The policy this replaced (stay 2 x the cost,
a batch of 8, 120 s) was one of them. Fewer swaps are only a means; the rule that pays is the
one against the proxy's 503.

Imported by what applies a decision: nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Before a runtime's first switch is on record: what one took on the demo's CPU, rounded up.
DEFAULT_COST_S = {"llamacpp": 10.0, "vllm": 60.0}
FALLBACK_COST_S = 60.0

# Why a swap happens: on demand, a request waiting too long, an idle return; by hand and
# failover are the switch command's and the monitor's.
DEMAND, STARVING, IDLE_RETURN = "demand", "starving", "idle return"


@dataclass(frozen=True)
class Waiting:
    """The requests queued at the proxy for the model one runtime serves."""

    runtime: str
    count: int
    oldest_s: float  # how long the oldest of them has waited
    tokens: int = 0  # the most tokens of an answer they ask for, together (as far as they say)


@dataclass(frozen=True)
class Card:
    """What a card (or the set of cards its runtimes take turns on) serves now."""

    serving: str | None  # the runtime serving there; None while none does
    since_s: float = 0.0  # how long it has served
    in_flight: int = 0  # its requests running now
    idle_s: float = 0.0  # how long since its last request ended (0 while one runs)
    pinned_s: float = 0.0  # how long a pin by hand still holds it


FCFS, COLLATED, POLICY = "fcfs", "collated", "policy"
ORDERS = (POLICY, COLLATED, FCFS)
# A request is swapped for this long before the proxy's hold would end, with its swap's cost
DEADLINE_MARGIN_S = 10.0


@dataclass(frozen=True)
class Policy:
    # `policy`: a request that waited this long once it could be served goes first (None: only
    # when the proxy's hold would otherwise end before its swap did)
    max_wait_s: float | None = None
    stay_factor: float = 0.0  # a runtime serves at least this many times its swap's cost (0: off)
    batch: int = 0  # this many waiting for another swap a busy runtime out (0: off)
    idle_return_s: float | None = None  # back to the default runtime after this long idle
    default_runtime: str | None = None
    order: str = POLICY
    hold_s: float | None = None  # how long the proxy holds a request before it answers 503


@dataclass(frozen=True)
class Decision:
    target: str | None  # the runtime to switch to now; None: the card stays as it is
    reason: str  # why: DEMAND, STARVING, IDLE_RETURN, or why it stays
    recheck_s: float | None = None  # when it may change with no new request (a timer to set)


def cost_of(runtime: str, engine: str, switch_times_s: Mapping[str, float]) -> float:
    """What a swap to `runtime` costs: its last switch time on record, else its engine's default."""
    return switch_times_s.get(runtime) or DEFAULT_COST_S.get(engine, FALLBACK_COST_S)


def decide(
    card: Card, waiting: Sequence[Waiting], cost_s: Mapping[str, float], policy: Policy
) -> Decision:
    """What the card should do now. `waiting`: the queues, per runtime, the serving runtime's
    own among them (requests waiting for one of its places); `cost_s`: what a swap to each
    runtime costs (`cost_of`), which breaks a tie between two as old."""
    others = [w for w in waiting if w.count > 0 and w.runtime != card.serving]
    own = [w for w in waiting if w.count > 0 and w.runtime == card.serving]
    if card.pinned_s > 0:
        return Decision(None, "pinned", card.pinned_s)
    if not others:
        return _idle(card, policy)
    first = max(others, key=lambda w: (w.oldest_s, w.count, w.tokens, -cost_s.get(w.runtime, 0.0)))
    if card.serving is None or policy.order == FCFS:
        return Decision(first.runtime, DEMAND)
    if policy.order == COLLATED:
        if card.in_flight == 0 and not own:
            return Decision(first.runtime, DEMAND)  # nothing left for it: the next in line
        return Decision(None, "busy")
    # What waited for the serving runtime when it swapped in is served before it swaps out
    if any(w.oldest_s >= card.since_s for w in own):
        return Decision(None, "serves what waited for its swap in")

    # A request waits from when it could have been served: not before this swap in ended
    def waited(w: Waiting) -> float:
        return min(w.oldest_s, card.since_s)

    rechecks = []
    if policy.hold_s is not None:  # answered 503 when its hold ends: swap while it still can

        def left(w: Waiting) -> float:
            cost = cost_s.get(w.runtime, FALLBACK_COST_S)
            return float(policy.hold_s) - DEADLINE_MARGIN_S - cost - w.oldest_s  # type: ignore[arg-type]

        due = min(others, key=left)
        if left(due) <= 0:
            return Decision(due.runtime, STARVING)
        rechecks.append(left(due))
    if policy.max_wait_s is not None:
        longest = max(others, key=waited)
        if waited(longest) >= policy.max_wait_s:
            return Decision(longest.runtime, STARVING)
        rechecks.append(policy.max_wait_s - waited(longest))
    recheck = min(rechecks, default=None)
    stay_s = policy.stay_factor * cost_s.get(str(card.serving), FALLBACK_COST_S)
    if card.since_s < stay_s:
        return Decision(None, "stays after its swap in", min([*rechecks, stay_s - card.since_s]))
    if card.in_flight == 0 and not own:
        return Decision(first.runtime, DEMAND)  # nothing left for it: the next in line
    if policy.batch > 0 and sum(w.count for w in others) >= policy.batch:
        return Decision(first.runtime, DEMAND)
    return Decision(None, "busy", recheck)


def _idle(card: Card, policy: Policy) -> Decision:
    back = policy.default_runtime
    if policy.idle_return_s is None or back is None or card.serving == back:
        return Decision(None, "no demand")
    if card.in_flight > 0:
        return Decision(None, "no demand", policy.idle_return_s)
    if card.idle_s >= policy.idle_return_s:
        return Decision(back, IDLE_RETURN)
    return Decision(None, "no demand", policy.idle_return_s - card.idle_s)
