"""After a switch that was killed (SIGKILL, a crash: no cleanup ran): record it, and leave one
runtime serving that is also the one enabled at boot."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from appliance import hold as hold_mark
from appliance.config import Config
from appliance.errors import ApplianceError
from appliance.host.placement import excludes
from appliance.layout import Layout, layout
from appliance.switch.lock import killed_switch
from appliance.switch.records import record_switch
from appliance.units import runtimes, systemd
from appliance.units.serving import (
    LOOK_S,
    Progress,
    enable_only,
    no_progress,
    serving_runtimes,
    wait_started,
)


def recover_killed(
    config: Config,
    lay: Layout,
    sd: systemd.Systemd,
    trace: dict[str, Any],
    progress: Progress,
    wait: bool,
) -> str | None:
    """After a switch that was killed (no cleanup ran): record it, and leave one runtime serving
    that is also the one enabled at boot. Returns what was done, or None while systemd is still
    finishing a job the killed switch started (then the trace stays for the next command).

    1. A runtime unit still has a job pending: with `wait`, wait for it; else come back later.
    2. One runtime serves on the switch's cards: it becomes the one enabled at boot there.
    3. None serves there: the one enabled at boot is started (the default runtime if none is).
    Runtimes on other cards (side by side) are left as they are.
    """
    target = config.runtimes.get(str(trace.get("target")))
    # The runtimes on the killed switch's cards; those on other cards were never touched.
    group = {
        name: rt.unit
        for name, rt in config.runtimes.items()
        if target is None or rt.name == target.name or excludes(rt, target)
    }
    for rt in config.runtimes.values():
        if rt.name not in group or not sd.properties(rt.unit).job_pending:
            continue
        if not wait:
            return None
        progress("recovering", f"waiting for systemd to finish its job on {rt.unit}")
        _wait_settled(sd, rt.unit, rt.start_timeout_s + runtimes.stop_timeouts(rt).unit_s + 30)
    serving = [name for name in serving_runtimes(config, sd) if name in group]
    if serving:
        done = f"{serving[0]} is serving; it is now the runtime enabled at boot"
        enable_only(config, sd, serving[0])
    else:
        done = _start_enabled(config, sd, group, progress, wait)
    (lay.state_dir / hold_mark.HOLD_FILE).unlink(missing_ok=True)
    _record_killed(lay, trace, done, progress)
    return done


def _start_enabled(
    config: Config, sd: systemd.Systemd, group: dict[str, str], progress: Progress, wait: bool
) -> str:
    """No runtime serves on the killed switch's cards: start the one enabled at boot there (the
    default runtime if none is). Returns what was done."""
    enabled = [n for n, u in sorted(group.items()) if sd.properties(u).unit_file_state == "enabled"]
    default = config.default_runtime if config.default_runtime in group else sorted(group)[0]
    name = enabled[0] if enabled else default
    rt = config.runtime(name)
    progress("recovering", f"no runtime is serving: starting {rt.unit}")
    sd.reset_failed(rt.unit)
    sd.start(rt.unit)
    enable_only(config, sd, name)
    done = f"no runtime was serving; started {name}, the runtime enabled at boot"
    if wait:
        try:
            wait_started(sd, rt.unit, rt.start_timeout_s + 60, progress)
        except ApplianceError as e:
            done += f", which failed: {e.message}"
    return done


def _record_killed(lay: Layout, trace: dict[str, Any], done: str, progress: Progress) -> None:
    """The killed switch goes into the switch history as interrupted, with what recovery did."""
    pid, phase = trace.get("pid"), trace.get("phase")
    error = f"b70ctl switch (pid {pid}) was killed during {phase or 'its start-up'}; {done}"
    record: dict[str, Any] = {
        "at": time.time(),
        "from": trace.get("previous"),
        "to": trace.get("target"),
        "ok": False,
        "seconds": round(time.time() - float(trace.get("started_at") or time.time()), 3),
        "phases": {},
        "rolled_back": False,
        "interrupted": True,
        "error": error,
    }
    unrecorded = record_switch(lay.state_dir, record)
    progress("recovered", error + (f" ({unrecorded})" if unrecorded else ""))


def _wait_settled(sd: systemd.Systemd, unit: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while sd.properties(unit).job_pending and time.monotonic() < deadline:
        sd.wait_change(min(LOOK_S, max(0.0, deadline - time.monotonic())))


def recover_killed_switch(
    config: Config, sd: systemd.Systemd, state_dir: Path
) -> dict[str, Any] | None:
    """Finds a switch that was killed and recovers from it without waiting (recover_killed):
    what `status` and the monitor do first. Returns its trace while it cannot be recovered yet."""
    with killed_switch(state_dir) as trace:
        if trace is None:
            return None
        lay = layout(sd.scope)
        if recover_killed(config, lay, sd, trace.info, no_progress, wait=False):
            trace.clear_stale()
            return None
        return trace.info
