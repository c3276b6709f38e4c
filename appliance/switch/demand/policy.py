"""Switch on demand (`[switching] on_demand`): which runtime a card should serve next, when
requests wait at the proxy for a model whose runtime does not serve. A pure function of what was
observed (the queues, what serves and since when, what each swap costs) and the policy; the
proxy's queue and the switch that applies a decision are elsewhere.

What a swap costs is the runtime's switch time, from its records (a default by engine before its
first): about 5 s for llama.cpp and 35-55 s for vLLM on the demo's CPU, minutes for vLLM on a
B70. First-come-first-served swapping (llama-swap, llama.cpp's router) swaps as soon as the
requests in flight end; under traffic for two models at once it swaps for nearly every request
and pays the swap each time. The rules, in order:

1. Pinned: a runtime pinned by hand (`b70ctl switch NAME --pin`) serves until the pin ends.
2. Nothing serves: the waiting runtime with the most demand starts at once.
3. Starving: a request that has waited `max_wait_s` goes first, whatever else holds.
4. Stay after a swap in: a runtime serves at least `stay_factor` times what its swap cost before
   demand swaps it out, so that a costly swap is not thrown away on a lull.
5. Busy: while the serving runtime has requests in flight, it stays, unless `batch` requests or
   more wait for another (then the swap is worth a drain).
6. Otherwise the runtime with the most demand swaps in: most requests waiting, then the most
   tokens they ask for, then the oldest, then the cheaper swap.
7. Idle return: with `idle_return_s`, a card idle that long with no queue goes back to its
   default runtime.

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


@dataclass(frozen=True)
class Policy:
    max_wait_s: float = 120.0  # no request waits longer before its runtime goes first
    stay_factor: float = 2.0  # a runtime serves at least this many times its swap's cost
    batch: int = 8  # requests waiting for another runtime that are worth draining a busy one
    idle_return_s: float | None = None  # back to the default runtime after this long idle
    default_runtime: str | None = None


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
    """What the card should do now. `waiting`: the queues, per runtime; `cost_s`: what a swap to
    each runtime costs (`cost_of`)."""
    others = [w for w in waiting if w.count > 0 and w.runtime != card.serving]
    if card.pinned_s > 0:
        return Decision(None, "pinned", card.pinned_s)
    if not others:
        return _idle(card, policy)
    best = max(others, key=lambda w: (w.count, w.tokens, w.oldest_s, -cost_s.get(w.runtime, 0.0)))
    if card.serving is None:
        return Decision(best.runtime, DEMAND)
    starving = [w for w in others if w.oldest_s >= policy.max_wait_s]
    if starving:
        return Decision(max(starving, key=lambda w: w.oldest_s).runtime, STARVING)
    # The first moment a waiting request starves, which the rules below never wait past
    starves_in = policy.max_wait_s - max(w.oldest_s for w in others)
    stay_s = policy.stay_factor * cost_s.get(card.serving, FALLBACK_COST_S)
    if card.since_s < stay_s:
        return Decision(None, "stays after its swap in", min(stay_s - card.since_s, starves_in))
    if card.in_flight > 0 and best.count < policy.batch:
        return Decision(None, "busy", starves_in)
    return Decision(best.runtime, DEMAND)


def _idle(card: Card, policy: Policy) -> Decision:
    back = policy.default_runtime
    if policy.idle_return_s is None or back is None or card.serving == back:
        return Decision(None, "no demand")
    if card.in_flight > 0:
        return Decision(None, "no demand", policy.idle_return_s)
    if card.idle_s >= policy.idle_return_s:
        return Decision(back, IDLE_RETURN)
    return Decision(None, "no demand", policy.idle_return_s - card.idle_s)
