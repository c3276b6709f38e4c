"""Warm at install: each runtime whose lasting cache is cold for its installed recipe (no start of
that recipe has succeeded yet) is started once through a switch, so that its first start on
demand is a warm one; then what served before serves again. And what doctor and install say of
the caches: each one's size, whether it is warm, and a request hold shorter than a swap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from appliance import engines
from appliance.config import Config, RuntimeConfig
from appliance.engines import lasting
from appliance.errors import ApplianceError
from appliance.host.doctor import Check
from appliance.layout import Layout, Scope, layout
from appliance.switch.records import read_history, swap_figures
from appliance.units import systemd
from appliance.units.render import recipe_folder
from appliance.units.serving import Progress, active_runtimes, no_progress


def mark_started(config: Config, lay: Layout, rt: RuntimeConfig) -> None:
    """A start of `rt`'s installed recipe succeeded: its cache holds what that start compiled."""
    lasting.mark_started(recipe_folder(config, lay, rt))


def is_cold(config: Config, lay: Layout, rt: RuntimeConfig) -> bool:
    """Whether `rt` would compile at its next start: its recipe compiles, and no start of it
    has succeeded with this cache."""
    if not engines.of(rt.engine).compiles(rt.args) or rt.cache_max_bytes == 0:
        return False
    return not lasting.was_started(recipe_folder(config, lay, rt))


@dataclass
class Warmed:
    warmed: list[str] = field(default_factory=list)
    cold: dict[str, str] = field(default_factory=dict)  # runtime -> why it is still cold
    serving: list[str] = field(default_factory=list)


def warm(config: Config, scope: Scope, progress: Progress = no_progress) -> Warmed:
    """Start each cold runtime once, then hand back to what served (the default runtime if
    nothing did). A failed warm-up rolls back as any switch does and leaves the runtime cold;
    Ctrl-C stops the warming, hands back, and says which runtimes are still cold."""
    from appliance.switch import apply
    from appliance.switch.interrupts import SwitchInterrupted

    lay = layout(scope)
    out = Warmed()
    with systemd.connect(scope) as sd:
        serving = active_runtimes(config, sd)
    for name in serving:  # started by install itself: its start filled its cache
        mark_started(config, lay, config.runtime(name))
    # by what a switch takes: a replica set's name for its replicas, one card at a time
    cold = targets(config, [n for n, rt in config.runtimes.items() if is_cold(config, lay, rt)])
    back = targets(config, serving) or [config.default_runtime]
    out.serving = back
    if not cold:
        return out
    interrupted = False
    try:
        for name in cold:
            progress("warming", f"{name}: its first start compiles; its cache is kept for the next")
            try:
                apply.switch(config, scope, name, progress=progress, reason="warm-up at install")
                out.warmed.append(name)
            except SwitchInterrupted:
                raise
            except ApplianceError as e:
                out.cold[name] = e.message.splitlines()[0]
    except (SwitchInterrupted, KeyboardInterrupt):
        interrupted = True
    finally:
        for name in cold:  # a start interrupted once it had begun is finished, and warm
            if name not in out.warmed and name not in out.cold:
                if any(is_cold(config, lay, config.runtime(m)) for m in config.members(name)):
                    out.cold[name] = "the warm-up was interrupted"
                else:
                    out.warmed.append(name)
        hand_back(config, scope, back, serving, progress)
    if interrupted:
        still = ", ".join(sorted(out.cold)) or "none"
        raise SwitchInterrupted(
            f"the warm-up was interrupted; {', '.join(back)} serves; still cold: {still}",
            recorded=True,
        )
    return out


def targets(config: Config, names: list[str]) -> list[str]:
    """What a switch is asked for, to bring up `names`: each one, or its replica set."""
    out: list[str] = []
    for name in sorted(names):
        target = config.runtime(name).group or name
        if target not in out:
            out.append(target)
    return out


def hand_back(
    config: Config, scope: Scope, back: list[str], serving: list[str], progress: Progress
) -> None:
    """What served before the warm-up serves again, and nothing else it started: a runtime
    warmed beside the others (on cards of its own) is stopped."""
    from appliance.switch import apply

    for name in back:
        progress("warming", f"done: {name} serves again")
        apply.switch(config, scope, name, progress=progress, reason="warm-up at install")
    with systemd.connect(scope) as sd:
        for name in active_runtimes(config, sd):
            if name not in serving and (config.runtime(name).group or name) not in back:
                sd.stop(config.runtime(name).unit)


# --- what doctor and install say ---------------------------------------------------------------


def cache_checks(config: Config, scope: Scope, root: Path) -> list[Check]:
    """Each runtime's lasting cache: its size, and whether it is warm for the installed recipe
    (its cards read under `root`; where they cannot be placed, doctor's card checks say why)."""
    from appliance.host.gpu.sysfs import read_devices

    lay = layout(scope)
    devices = read_devices(root)
    try:
        folders = {n: recipe_folder(config, lay, rt, devices) for n, rt in config.runtimes.items()}
    except ApplianceError:
        return []
    out = []
    for name, rt in sorted(config.runtimes.items()):
        folder = folders[name]
        state = lasting.state(folder)
        held = lasting.mib(state.held_bytes)
        if rt.cache_max_bytes == 0:
            detail = "off (cache_max_gib = 0): every start compiles"
        elif not state.readable:
            detail = f"{folder} is its runtime's user's alone: root's doctor shows it"
        elif not engines.of(rt.engine).compiles(rt.args):
            detail = f"{held} at {folder}; its recipe compiles nothing"
        elif state.started:
            detail = f"warm for the installed recipe: {held} at {folder}"
        else:
            detail = (
                f"cold: no start of the installed recipe yet ({held} at {folder}); "
                f"`b70ctl install` warms it, or `b70ctl switch {name}`"
            )
        igc = sorted(k for k in rt.env if k.startswith("IGC_"))
        if igc:  # intel/compute-runtime commit 6975f7bb, in its releases 25.31 to 26.31
            detail += (
                f"; warning: {', '.join(igc)} set: Intel's compute runtime 25.31 to 26.31 keeps "
                "no kernels while any IGC_ variable is set, so on those drivers each start JITs"
            )
        out.append(Check(f"{name}: cache", True, detail))
    out += [Check("proxy: hold", True, "warning: " + w) for w in hold_warnings(config, lay)]
    return out


def hold_warnings(config: Config, lay: Layout) -> list[str]:
    """[proxy] hold_s against the costliest swap the records expect: a request held for a swap
    that takes longer gets a 503 before it is served."""
    figures, _ = swap_figures(read_history(lay.state_dir), config.runtimes)
    if not figures:
        return []
    name, f = max(figures.items(), key=lambda item: item[1].expected)
    if f.expected <= config.proxy.hold_s:
        return []
    how = "warm" if f.next_warm and f.warm is not None else "last"
    return [
        f"[proxy] hold_s = {config.proxy.hold_s:g} s is shorter than a swap to {name} "
        f"({f.expected:.0f} s, its {how} start on record): requests held for it get 503; "
        f"raise hold_s above {f.expected:.0f}"
    ]
