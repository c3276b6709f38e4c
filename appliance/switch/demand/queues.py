"""What waits for which runtime, as `status`, the status page and the metrics show it: the queues
at the proxy by runtime port, named by the model served there and the runtime a request for it
brings up; the pin; the runtimes refused after a failed start; the last look's reason."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from appliance import hold
from appliance.config import Config
from appliance.switch.demand.pins import read_pin
from appliance.switch.demand.policy import cost_of
from appliance.switch.records import read_history, swap_figures


def target_of(config: Config, port: int) -> str | None:
    """The runtime a request for `port` brings up: the only one there, else the default runtime
    if it is one of them, else the first by name. Replicas are the router's, not demand's."""
    names = [n for n, rt in sorted(config.runtimes.items()) if rt.port == port and not rt.group]
    if config.default_runtime in names:
        return config.default_runtime
    return names[0] if names else None


def queues(config: Config, state_dir: Path, now: float | None = None) -> list[dict[str, Any]]:
    """One entry per runtime port that has requests waiting: its model, the runtime that serves
    it (or would), how many wait and for how long the oldest has."""
    now = time.time() if now is None else now
    models = {rt.port: rt.served_model_name for rt in config.runtimes.values()}
    out = []
    for port, queue in sorted(hold.read_queues(state_dir).items()):
        out.append(
            {
                "model": models.get(port),
                "port": port,
                "runtime": target_of(config, port),
                "waiting": queue.count,
                "tokens": queue.tokens,
                "oldest_s": round(max(0.0, now - queue.oldest), 1),
            }
        )
    return out


def demand_view(config: Config, state_dir: Path, last: dict[str, Any] | None) -> dict[str, Any]:
    """The switch on demand as `status --json` gives it. `last`: the last switch's record."""
    now = time.time()
    record = hold.read_demand(state_dir)
    refused = record.get("refused")
    pin = read_pin(state_dir, now)
    figures, _ = swap_figures(read_history(state_dir), config.runtimes)
    took = {name: f.expected for name, f in figures.items()}
    return {
        "on_demand": config.switching.on_demand,
        "order": config.switching.order,
        "fcfs": config.switching.fcfs,
        # what a swap to each runtime is expected to take, and whether its records say so
        "costs": {
            name: {
                "seconds": round(cost_of(name, rt.engine.value, took), 1),
                "from": "records" if name in took else "default",
                # cold and warm starts apart (appliance.engines.lasting), where records show them
                "cold_s": _rounded(figures[name].cold) if name in figures else None,
                "warm_s": _rounded(figures[name].warm) if name in figures else None,
                "next": _next(figures[name].next_warm) if name in figures else None,
            }
            for name, rt in sorted(config.runtimes.items())
        },
        "queues": queues(config, state_dir, now),
        "decision": record.get("decision") if config.switching.on_demand else None,
        "refused": [
            {**entry, "left_s": round(left, 1)}
            for entry in (refused.values() if isinstance(refused, dict) else ())
            if (left := _left_s(entry, now)) > 0
        ],
        "pin": None if pin is None else {**pin.__dict__, "left_s": round(pin.left_s(now), 1)},
        # Records written before switches said why are by hand
        "last_reason": None if last is None else last.get("reason", "by hand"),
    }


def _next(warm: bool | None) -> str | None:
    """Whether a runtime's next start finds its cache warm; None where no start said."""
    return None if warm is None else "warm" if warm else "cold"


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def _left_s(entry: object, now: float) -> float:
    """How long a refusal still holds; 0 for one that ended or that is not a refusal."""
    try:
        return float(entry["until"]) - now  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return 0.0
