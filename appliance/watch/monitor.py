"""`b70ctl monitor` (b70-monitor.service): watch the serving runtimes, heal them, export metrics.

Every interval it samples backend and proxy health, a tiny completion on the runtime, GPU
memory and the runtime's own metrics, and exports them to Prometheus on loopback. systemd
restarts a runtime that crashes (Restart=on-failure); the monitor handles what systemd cannot
see: a hung runtime, one that does not come back, as decided by appliance.switch.plans.judge.

Every decision is written to the monitor's record with its reason; `b70ctl status` shows it.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import hold as hold_mark
from appliance.config import Config, RuntimeConfig
from appliance.errors import ApplianceError, from_exception
from appliance.files import write_atomic
from appliance.host import gpu, health, runtime_http
from appliance.host.placement import excludes
from appliance.layout import MONITOR_RECORD, PROXY_UNIT, Layout, Scope, layout
from appliance.switch.lock import switch_running, try_lock
from appliance.switch.plans import Action, Memory, Observation, judge
from appliance.switch.recovery import recover_killed_switch
from appliance.units import runtimes, systemd
from appliance.watch import samples

if TYPE_CHECKING:
    import ssl

FAILOVER_BACKOFF_S = 60


# --- the loop ----------------------------------------------------------------------------------


def observe(config: Config, sd: systemd.Systemd, state_dir: Path) -> list[Observation]:
    """One observation per runtime to watch: each one active or starting, and a failed one that
    is enabled at boot (a failed unit that is not a chosen runtime is history, not news); one
    with no runtime when there is none. Runtimes serving side by side are each watched."""
    now, switching = time.time(), switch_running(state_dir)
    out = []
    for name, rt in sorted(config.runtimes.items()):
        st = sd.properties(rt.unit)
        if st.active_state not in {"active", "activating", "failed"}:
            continue
        if st.active_state == "failed" and st.unit_file_state != "enabled":
            continue
        o = Observation(
            now, name, st.active_state, st.sub_state, st.main_pid, False, "not active",
            switching,
        )  # fmt: skip
        if st.active_state == "active":
            _probe(config, rt, o)
        out.append(o)
    return out or [Observation(now, None, None, None, None, False, "no runtime", switching)]


def _probe(config: Config, rt: RuntimeConfig, o: Observation) -> None:
    """Its health, a probe completion, and its own metrics, into the observation."""
    mon = config.monitor
    url = runtimes.backend_url(config, rt)
    probe = health.probe(url + runtime_http.HEALTH_PATH, timeout_s=mon.health_timeout_s)
    o.healthy, o.detail = probe.healthy, f"/health: {probe.detail}"
    if o.healthy and mon.probe_completion:
        o.healthy, o.detail = _probe_completion(url, rt.served_model_name, mon.probe_timeout_s)
    o.in_flight, o.generated = health.read_work(url, timeout_s=mon.health_timeout_s)


def fallback_for(config: Config, runtime: str | None) -> str | None:
    """[monitor] fallback, for a runtime it can replace: one that shares a card with it (a
    fallback on other cards would not take its place)."""
    fallback = config.monitor.fallback
    if fallback is None or runtime is None or runtime not in config.runtimes:
        return None
    return fallback if excludes(config.runtime(fallback), config.runtime(runtime)) else None


def _probe_completion(url: str, model: str, timeout_s: float) -> tuple[bool, str]:
    body = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
    try:
        answer = health.request("POST", url + "/v1/completions", timeout_s, body=body)
    except health.NoAnswer as e:
        return False, f"probe completion: {e.detail}"
    ok = answer.status == 200
    return ok, "ok" if ok else f"probe completion: HTTP {answer.status}"


def act(
    config: Config,
    scope: Scope,
    sd: systemd.Systemd,
    action: Action,
    m: Memory,
    log: Any,
    mine: Memory | None = None,
    persist: Callable[[], object] | None = None,
) -> None:
    """Restart or fail over; counted in `m`; a failed failover backs off `mine` (the runtime's
    memory, or `m`). `persist`: writes the count down before systemd is asked, so that a
    monitor killed while the restart runs still has it when it comes back."""
    m.last_action = {
        "at": time.time(),
        "what": action.kind,
        "runtime": action.runtime,
        "reason": action.reason,
    }
    log(f"{action.kind} {action.runtime}: {action.reason}")
    if action.kind == "restart":
        m.restarts_by_monitor += 1
        if mine is not None and mine is not m:
            mine.restarts_by_monitor += 1  # the runtime's own count, for its metric
        if persist is not None:
            persist()
        try:
            _restart_unless_switching(config, sd, action.runtime)
        except ApplianceError as e:  # systemd refused: say so, and judge again next sample
            m.last_action["result"] = f"restart failed: {e.message}"
            log(f"restart of {action.runtime} failed: {e.message}")
        return
    from appliance.switch import apply

    m.failovers += 1
    try:
        apply.switch(config, scope, action.runtime, reason="failover")
        m.last_action["result"] = f"{action.runtime} is serving"
    except ApplianceError as e:
        m.last_action["result"] = f"failover failed: {e.message}"
        (mine or m).hold_until = time.time() + FAILOVER_BACKOFF_S
        log(f"failover to {action.runtime} failed: {e.message}; again in {FAILOVER_BACKOFF_S} s")


def _restart_unless_switching(config: Config, sd: systemd.Systemd, runtime: str) -> None:
    """RestartUnit under the switch lock: a switch that began while the monitor probed (for up
    to its probe timeouts) may be draining this very runtime, and is left alone."""
    state_dir = layout(sd.scope).state_dir
    with try_lock(state_dir) as held:
        if not held or hold_mark.read_mark(state_dir) is not None:
            raise ApplianceError(f"a switch began meanwhile; {runtime} is left to it")
        sd.restart(config.runtime(runtime).unit)


def observation_doc(o: Observation) -> dict[str, Any]:
    """An observation as the record and `monitor --once --json` give it; `unit_state` repeats
    `active_state` under the key that scripts read."""
    return {**asdict(o), "unit_state": o.active_state}


def save(state_dir: Path, m: Memory, o: Observation | None, log: Any = None) -> dict[str, Any]:
    """Write the monitor's record, for `status` and for its next start. A record that cannot be
    written (a full file system) is logged once, not fatal: the monitor goes on watching, and
    its counters live on in memory until the file can be written again."""
    doc = asdict(m)
    doc["last_observation"] = observation_doc(o) if o else None
    doc["pid"] = os.getpid()
    try:
        write_atomic(state_dir / MONITOR_RECORD, json.dumps(doc, sort_keys=True) + "\n")
    except OSError as e:
        problem = f"cannot save the monitor's record: {e.filename}: {e.strerror or e}"
        if log is not None and m.unsaved != problem:
            log(problem + "; it is kept in memory until it can be written")
        m.unsaved = problem
        return doc
    if log is not None and m.unsaved:
        log("the monitor's record is saved again")
    m.unsaved = None
    return doc


# What survives a restart of the monitor: its counters and what it last saw and did; not what it
# was in the middle of (failures in a row, a backoff).
KEPT = {
    "restarts_by_monitor": int,
    "failovers": int,
    "last_failure": dict,
    "last_action": dict,
}


def restore(state_dir: Path) -> Memory:
    m = Memory()
    data = samples.read_monitor(state_dir) or {}
    for key, kind in KEPT.items():
        value = data.get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            setattr(m, key, value)
    return m


def page_tls(config: Config, lay: Layout) -> ssl.SSLContext | None:
    """The status page's TLS: the proxy's certificate and key ([proxy] tls, which the config
    asks for beyond loopback); None without it."""
    from appliance.keys import server_context, tls_files

    files = tls_files(config.proxy.tls, config.proxy.tls_cert, config.proxy.tls_key, lay.state_dir)
    return server_context(files.cert, files.key) if files is not None else None


def run(config: Config, scope: Scope, log: Any, once: bool = False) -> dict[str, Any]:
    """Sample and act every interval; with `once`, one sample, returned as the record has it."""
    from appliance.watch import metrics

    lay = layout(scope)
    mon = config.monitor
    exporter = metrics.Exporter(config)
    m = restore(lay.state_dir)
    if not once:  # one sample serves no scrape; and the monitor's unit may hold the port
        from appliance.watch import statuspage

        page = statuspage.Page(config, lay, exporter.registry)
        tls = page_tls(config, lay) if page.exposed else None
        statuspage.serve(page, mon.host, mon.port, tls=tls)
        where = f"{'https' if tls else 'http'}://{mon.host}:{mon.port}"
        log(f"monitoring every {mon.interval_s:g} s; status page on {where}/, metrics on /metrics")
    if not once and config.switching.on_demand:
        _start_demand(config, scope, log)
    trouble: str | None = None  # what made the last sample fail, logged once while it lasts
    watched: dict[str, Memory] = {}  # each runtime's failures in a row, restarts, backoff
    while True:
        try:
            doc = sample(config, scope, lay, m, exporter, log, watched)
        except (ApplianceError, OSError) as e:
            # A sample that fails (an unreachable manager, a state directory that cannot be
            # written) is logged, not fatal: the monitor watches on and tries again next time.
            if once:
                raise
            problem = str(from_exception(e).message)
            if problem != trouble:
                log(f"this sample failed: {problem}; the monitor goes on")
            trouble = problem
        else:
            if trouble is not None:
                log("samples succeed again")
            trouble = None
            if once:
                return doc
        time.sleep(mon.interval_s)


def _start_demand(config: Config, scope: Scope, log: Any) -> None:
    """The switch on demand, beside the samples: its looks are twice a second, a sample's every
    interval_s, and a swap it makes takes as long as a switch."""
    from appliance.switch.demand.runner import Runner
    from appliance.switch.interrupts import start_blocked

    runner = Runner(config, scope, log)
    start_blocked(threading.Thread(target=runner.run, name="on-demand", daemon=True))
    s = config.switching
    log(f"switching on demand (order {s.order})")


def sample(
    config: Config,
    scope: Scope,
    lay: Layout,
    m: Memory,
    exporter: Any,
    log: Any,
    watched: dict[str, Memory] | None = None,
) -> dict[str, Any]:
    """One sample: recover a killed switch, observe each runtime, judge and act on each (its
    failures in a row are its own, in `watched`), export, save. The counters are `m`'s."""
    mon = config.monitor
    watched = {} if watched is None else watched
    with systemd.connect(scope) as sd:
        recover_killed_switch(config, sd, lay.state_dir)
        observed = observe(config, sd, lay.state_dir)
        for o in observed:
            mine = watched.setdefault(o.runtime or "", Memory(runtime=o.runtime))
            action = judge(
                mine, o, mon.hang_after, mon.restart_tries, fallback_for(config, o.runtime)
            )
            if mine.last_failure and mine.last_failure != m.last_failure:
                m.last_failure = mine.last_failure
            if action:
                persist = functools.partial(save, lay.state_dir, m, o, log)
                act(config, scope, sd, action, m, log, mine, persist)
                save(lay.state_dir, m, o, log)  # and what the restart or failover came to
        units = {rt.unit: sd.properties(rt.unit) for rt in config.runtimes.values()}
        units[PROXY_UNIT] = sd.properties(PROXY_UNIT)
    o = observed[0]  # the first runtime by name: the one the record describes
    first = watched[o.runtime or ""]
    m.runtime, m.failures, m.restarts = first.runtime, first.failures, first.restarts
    proxy = health.probe(
        runtimes.proxy_url(config) + health.PROXY_HEALTH_PATH, mon.health_timeout_s
    )
    snap = gpu.snapshot(gpu.sysroot())
    exporter.update(observed, m, units, proxy.healthy, snap, lay.state_dir, watched)
    samples.append(lay.state_dir, samples.sample_of(observed, exporter.snapshot["held"].now, snap))
    doc = save(lay.state_dir, m, o, log)
    doc["observations"] = [observation_doc(each) for each in observed]
    return doc
