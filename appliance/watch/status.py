"""What `b70ctl status` reports: units, health, the last switch and the monitor's view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance import hold
from appliance.config import Config, Launcher
from appliance.errors import ConfigError
from appliance.host import health, placement, processes, runtime_http
from appliance.keys import file_fingerprint, tls_files
from appliance.layout import MONITOR_UNIT, PROXY_SOCKET, PROXY_UNIT, Scope, layout
from appliance.switch.demand.queues import demand_view
from appliance.switch.lock import waiting_trace
from appliance.switch.records import last_switch
from appliance.units import runtimes, systemd


def status(config: Config, scope: Scope) -> dict[str, Any]:
    lay = layout(scope)
    units = [rt.unit for _, rt in sorted(config.runtimes.items())]
    units += [PROXY_SOCKET, PROXY_UNIT, MONITOR_UNIT]
    with systemd.connect(scope) as sd:
        killed = waiting_trace(lay.state_dir)  # status writes nothing, for any user
        props = {u: sd.properties(u) for u in units}
    active = [
        n for n, rt in sorted(config.runtimes.items()) if props[rt.unit].active_state == "active"
    ]
    urls, backend = _probe_backends(config, active)
    proxy = health.probe(runtimes.proxy_url(config) + health.PROXY_HEALTH_PATH)
    foreign = backend_squatter(config, props)
    cards = cards_view(config)
    last = last_switch(lay.state_dir)
    served = {
        rt.unit: {"port": rt.port, "model": rt.served_model_name, "apis": list(rt.apis)}
        for rt in config.runtimes.values()
    }
    return {
        "scope": scope.value,
        "config": str(config.path),
        "active_runtime": active[0] if len(active) == 1 else None,
        "active_runtimes": active,
        "units": [_unit_view(s, cards.get(s.name), served.get(s.name, {})) for s in props.values()],
        "backend": {
            "url": " ".join(urls),
            "healthy": backend.healthy and foreign is None,
            "detail": backend.detail if foreign is None else f"{backend.detail}; {foreign}",
            "foreign_listener": foreign,
        },
        "proxy": {
            "url": runtimes.proxy_url(config),
            "healthy": proxy.healthy,
            "detail": proxy.detail,
            "tls": tls_view(config, lay.state_dir),
        },
        "hold": hold_view(lay.state_dir),
        "last_switch": last,
        "demand": demand_view(config, lay.state_dir, last),
        # A switch that was killed: recovered by the next command that may write (a switch,
        # install, the monitor), not by status.
        "killed_switch": killed,
        "monitor": monitor_view(lay.state_dir),
    }


def tls_view(config: Config, state_dir: Path) -> dict[str, Any] | None:
    """The certificate the proxy serves over TLS, and its fingerprint (None: cannot be read)."""
    p = config.proxy
    files = tls_files(p.tls, p.tls_cert, p.tls_key, state_dir)
    if files is None:
        return None
    return {
        "cert": str(files.cert), "self_signed": files.made,
        "fingerprint": file_fingerprint(files.cert),
    }  # fmt: skip


def _probe_backends(config: Config, active: list[str]) -> tuple[list[str], health.Probe]:
    """Each serving runtime's port (side by side, several); none serving: the [backend] port.
    One probe of them all: healthy when each is."""
    urls = [runtimes.backend_url(config, config.runtimes[n]) for n in active]
    urls = urls or [runtimes.backend_url(config)]
    probes = [health.probe(url + runtime_http.HEALTH_PATH) for url in urls]
    return urls, health.Probe(
        all(p.healthy for p in probes),
        "; ".join(
            p.detail if len(probes) == 1 else f"{url}: {p.detail}"
            for url, p in zip(urls, probes, strict=True)
        ),
    )


def _unit_view(
    s: systemd.UnitProperties, cards: str | None, served: dict[str, Any]
) -> dict[str, Any]:
    return {
        "unit": s.name,
        "load": s.load_state,
        "active": s.active_state,
        "sub": s.sub_state,
        "enabled": s.unit_file_state,
        "main_pid": s.main_pid,
        "result": s.result,
        "since_us": s.active_enter_us,
        "restarts": s.n_restarts,  # systemd's own count (NRestarts)
        "cards": cards,
        **served,
    }


def cards_view(config: Config) -> dict[str, str]:
    """Each runtime unit's cards, when the config names cards: `cards 0-1 (0000:03:00.0, ...)`,
    or only the indices where this machine does not have them."""
    try:
        placed = placement.placements(config)
    except ConfigError:
        return {
            rt.unit: f"cards {','.join(map(str, rt.card_indices))} (not all found)"
            for rt in config.runtimes.values()
        }
    if placed is None:
        return {}
    return {config.runtimes[n].unit: placement.describe(c) for n, c in placed.items()}


def backend_squatter(config: Config, props: dict[str, systemd.UnitProperties]) -> str | None:
    """A process on a runtime port that no runtime unit started, named; None if there is none.

    A container runtime serves from a process outside its unit: while one runs, nothing is named.
    """
    running = [rt for rt in config.runtimes.values() if props[rt.unit].main_pid]
    if any(rt.launcher is not Launcher.NATIVE for rt in running):
        return None
    pids = [props[rt.unit].main_pid or 0 for rt in running]
    for port in sorted({rt.port for rt in config.runtimes.values()}):
        # A socket of another user's (pid None) cannot be told from the runtime's own by an
        # account that is not root, which sees only its own processes' sockets: not named.
        found = [f for f in processes.foreign_listeners(port, pids) if f.pid is not None]
        if found:
            described = processes.describe(found)
            return f"port {port} is held by {described}, which is not part of the appliance"
    return None


def hold_view(state_dir: Path) -> dict[str, Any]:
    """Requests waiting at the proxy, and the switch that holds them, if one runs."""
    mark = hold.read_mark(state_dir)
    counts = hold.read_counts(state_dir)
    return {
        "switching_to": mark.target if mark else None,
        "mark_problem": mark.problem if mark else None,  # a mark that exists and cannot be read
        "held_now": counts.now,
        "held_total": counts.total,
        "timed_out_total": counts.timed_out,
    }


def monitor_view(state_dir: Path) -> dict[str, Any] | None:
    from appliance.watch.samples import read_monitor

    data = read_monitor(state_dir)
    if data is None:
        return None
    return {
        "up_since": data.get("started_at"),
        "last_failure": data.get("last_failure"),
        "last_action": data.get("last_action"),
        "restarts_by_monitor": data.get("restarts_by_monitor"),
        "failovers": data.get("failovers"),
    }
