"""A rolling switch: a runtime with one replica per card (`per_card = true`) switched one card at a
time, so that the other replicas go on serving its name and capacity never drops to zero.

Each replica is switched as a runtime of its own (appliance.switch.executor.Switch): its
requests are held only at its port, where LiteLLM's router leaves it out (appliance.proxy.hook),
it is drained, stopped, started, verified through the proxy and enabled. A replica that fails is
rolled back by its own switch; the replicas switched before it are then switched back, last
first, so the set ends as it began.
"""

from __future__ import annotations

from appliance.errors import ApplianceError
from appliance.switch.executor import Switch, SwitchResult
from appliance.switch.interrupts import SwitchInterrupted
from appliance.units.serving import wait_stopped


def rolling(one: Switch, group: str, names: tuple[str, ...]) -> SwitchResult:
    """Switch the replicas `names` of `group` one after the other."""
    t0 = one.clock.monotonic()
    progress = one.interrupts.progress
    done: list[SwitchResult] = []
    for i, name in enumerate(names, 1):
        progress("replica", f"{name} ({i} of {len(names)}); the others serve meanwhile")
        try:
            done.append(one(name))
        except SwitchInterrupted as e:
            switched = ", ".join(r.target for r in done if r.ok) or "none"
            e.message += f"; the replicas switched before it stay switched: {switched}"
            raise
        except ApplianceError as e:
            undone = undo(one, done)
            e.message = f"rolling switch to {group} failed at {name}: {e.message}{undone}"
            raise
        received = one.interrupts.received
        if received and name != names[-1]:
            switched = ", ".join(r.target for r in done)
            raise SwitchInterrupted(
                f"interrupted by {received} during the rolling switch to {group}: switched "
                f"{switched}; the other replicas were not touched",
                recorded=True,
            )
    # What served before: the replicas each switch stopped (a replica that already served, itself)
    previous = sorted({p for r in done for p in r.stopped or ([r.previous] if r.previous else [])})
    return SwitchResult(
        target=group,
        previous=group_name(one, previous),
        ok=True,
        seconds=one.clock.monotonic() - t0,
        phases={r.target: r.seconds for r in done},
        notes=[note for r in done for note in r.notes if not note.startswith("GPU memory")],
        answer=done[-1].answer if done else None,
        stopped=[s for r in done for s in r.stopped],
    )


def undo(one: Switch, done: list[SwitchResult]) -> str:
    """Put back what served before on the cards of the replicas switched already, last first;
    what was done, to add to the error."""
    lines: list[str] = []
    for result in reversed(done):
        back = [s for s in result.stopped if s != result.target]
        try:
            if back:
                for name in back:
                    one(name)
                lines.append(f"{result.target}: {', '.join(back)} serving again")
            elif not result.stopped and result.previous is None:  # nothing served there before
                rt = one.config.runtime(result.target)
                one.sd.stop(rt.unit)
                wait_stopped(one.sd, rt.unit, rt.stop_timeout_s + 60)
                lines.append(f"{result.target}: stopped again")
        except ApplianceError as e:
            lines.append(f"{result.target}: putting it back failed: {e.message}")
    return "".join(f"\n  rolled back {line}" for line in lines)


def group_name(one: Switch, names: list[str]) -> str | None:
    """`small` for the replicas small-0..small-3; the names themselves otherwise."""
    groups = {one.config.runtimes[n].group for n in names if n in one.config.runtimes}
    if len(groups) == 1 and None not in groups:
        return groups.pop()
    return ", ".join(names) or None
