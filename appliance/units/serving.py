"""The appliance's units as systemd sees them: which runtime serves, waiting for a unit to
start or stop, and whose port is whose."""

from __future__ import annotations

import time
from collections.abc import Callable

from appliance.config import Config, Launcher
from appliance.errors import ApplianceError
from appliance.host import processes
from appliance.host.placement import excludes
from appliance.units import runtimes, systemd

Progress = Callable[[str, str], None]
# The waits wake when systemd signals a change, and at least this often to look anyway.
LOOK_S = 0.5


def no_progress(phase: str, detail: str) -> None:
    pass


SUB_STATE_PHASE = {
    "dead": "queued behind the old runtime's stop",
    "start-pre": "waiting for the GPU and the port",
    "start": "starting",
    "start-post": "loading",
    "running": "healthy",
    "stop-sigterm": "stopping",
    "stop": "stopping",
    "stop-post": "cleaning up",
}


def wait_started(
    sd: systemd.Systemd, unit: str, timeout_s: float, progress: Progress
) -> dict[str, float]:
    """Wait until `unit` is active with no job pending. Returns seconds spent per sub-state."""
    start = time.monotonic()
    phases: dict[str, float] = {}
    last_sub, last_t = "", start
    while True:
        st = sd.properties(unit)
        now = time.monotonic()
        if st.sub_state != last_sub:
            if last_sub:
                phases[last_sub] = phases.get(last_sub, 0.0) + now - last_t
            last_sub, last_t = st.sub_state, now
            progress(SUB_STATE_PHASE.get(st.sub_state, st.sub_state), unit)
        if st.active_state == "active" and not st.job_pending:
            return phases
        # Lost: systemd is about to retry it, or it settled anywhere but active ("failed" with a
        # job still pending is a restart's stop on its way to the start, not settled)
        if st.sub_state == "auto-restart" or (st.settled and st.active_state != "active"):
            raise ApplianceError(
                f"{unit} did not start: {st.active_state} ({st.sub_state}), result {st.result}",
                code="start_failed",
                details={"unit": unit, "result": st.result, "sub_state": st.sub_state},
            )
        if now - start > timeout_s:
            raise ApplianceError(
                f"{unit} did not become active within {timeout_s:.0f} s (still {st.sub_state})",
                code="start_timeout",
            )
        sd.wait_change(min(LOOK_S, start + timeout_s - now))


def wait_stopped(sd: systemd.Systemd, unit: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = sd.properties(unit)
        if st.active_state in {"inactive", "failed"} and not st.job_pending:
            return
        sd.wait_change(min(LOOK_S, max(0.0, deadline - time.monotonic())))
    raise ApplianceError(f"{unit} did not stop within {timeout_s:.0f} s", code="stop_timeout")


def serving_runtimes(config: Config, sd: systemd.Systemd) -> list[str]:
    """The runtimes whose units are active (the health guard makes active mean answering): one,
    or several side by side on their own cards."""
    return [
        name for name, rt in sorted(config.runtimes.items()) if sd.active_state(rt.unit) == "active"
    ]


def serving_runtime(config: Config, sd: systemd.Systemd) -> str | None:
    """The first runtime serving, by name (the only one unless runtimes serve side by side)."""
    serving = serving_runtimes(config, sd)
    return serving[0] if serving else None


def require_serving(config: Config, sd: systemd.Systemd) -> str:
    name = serving_runtime(config, sd)
    if name is None:
        raise ApplianceError(
            "no runtime is serving", hint="`b70ctl switch NAME` first", code="not_serving"
        )
    return name


# The states in which a unit's process may run: begun with the unit as systemd read it then
RUNNING = frozenset({"active", "activating", "reloading", "deactivating"})


def active_runtimes(config: Config, sd: systemd.Systemd) -> list[str]:
    out = []
    for name, rt in sorted(config.runtimes.items()):
        if sd.active_state(rt.unit) in RUNNING:
            out.append(name)
    return out


def check_port(
    sd: systemd.Systemd, units: list[str], port: int, role: str, config: Config | None = None
) -> None:
    """Refuse a port that a process outside `units` listens on, naming that process. With
    `config`, the processes of its runtimes' containers are the appliance's too: a container's
    server (host network) is not in its unit's process tree, and the engine is asked for it
    only when a listener is found outside the units."""
    pids = [pid for unit in units if (pid := sd.main_pid(unit))]
    foreign = processes.foreign_listeners(port, pids)
    if foreign and config is not None:
        ours = container_pids(config)
        foreign = [listener for listener in foreign if listener.pid not in ours]
    if foreign:
        raise ApplianceError(
            f"the {role} port {port} is held by {processes.describe(foreign)}, "
            "which is not part of the appliance",
            hint=f"stop that process, or choose another [{role}] port in the config",
            code="port_busy",
        )


def container_pids(config: Config) -> set[int]:
    """Processes of the appliance's containers: they live outside the b70 units' cgroups."""
    pids: set[int] = set()
    for rt in config.runtimes.values():
        if rt.launcher is not Launcher.NATIVE:
            cli = runtimes.container_cli(config, rt)
            pid = processes.container_pid(cli, runtimes.container_name(rt))
            if pid:
                pids |= processes.process_tree(pid)
    return pids


def enable_only(config: Config, sd: systemd.Systemd, name: str) -> None:
    """Make runtime `name` the one that starts at boot on its cards: the runtimes that share a
    card with it are disabled, those on other cards keep their say."""
    target = config.runtime(name)
    sd.disable(
        [rt.unit for rt in config.runtimes.values() if rt.name != name and excludes(rt, target)]
    )
    sd.enable([target.unit])
