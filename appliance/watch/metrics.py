"""Prometheus metrics of the monitor, served on loopback by prometheus-client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from appliance import hold, usage
from appliance.config import Config
from appliance.switch.demand.queues import demand_view
from appliance.switch.records import read_history


def switch_counts(state_dir: Path) -> tuple[int, int, dict[str, Any] | None, dict[str, int]]:
    """Switches, failed switches, the last switch's record, and the switches by why they were
    made (records older than the reason are by hand), from the switch records."""
    records = read_history(state_dir)
    failed = sum(not r.get("ok") for r in records)
    reasons: dict[str, int] = {}
    for r in records:
        reason = str(r.get("reason", "by hand"))
        reasons[reason] = reasons.get(reason, 0) + 1
    return len(records), failed, records[-1] if records else None, reasons


class Exporter(Collector):
    def __init__(self, config: Config) -> None:
        self.config = config
        self.snapshot: dict[str, Any] = {}
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.totals: usage.Totals | None = None  # each key's use, read on from where it was

    def update(
        self,
        observed: list[Any],
        m: Any,
        units: dict[str, Any],
        proxy_up: bool,
        snap: Any,
        state_dir: Path,
        watched: dict[str, Any] | None = None,
    ) -> None:
        """One sample: every runtime observed (several serve side by side on their own cards),
        the monitor's counters `m`, and each runtime's own memory in `watched`."""
        total, failed, last, reasons = switch_counts(state_dir)
        if self.totals is None:
            self.totals = usage.Totals(state_dir)
        self.snapshot = {
            "observed": [o for o in observed if o.runtime is not None],
            "m": m,
            "watched": watched or {},
            "units": units,
            "proxy_up": proxy_up,
            "gpu": snap,
            "switches": total,
            "switches_failed": failed,
            "last_switch": last,
            "held": hold.read_counts(state_dir),
            "reasons": reasons,
            "demand": demand_view(self.config, state_dir, last),
            "keys": dict(self.totals()),
        }

    def collect(self) -> Iterator[Any]:
        s = self.snapshot
        if not s:
            return
        yield from self._runtimes(s)
        yield from self._switches(s)
        yield from self._requests(s)
        yield from self._demand(s)
        yield from self._keys(s)
        yield from self._vram(s)

    def _runtimes(self, s: dict[str, Any]) -> Iterator[Any]:
        seen = {o.runtime: o for o in s["observed"]}
        active = GaugeMetricFamily(
            "b70_active_runtime", "1 for each runtime that serves", labels=["runtime"]
        )
        up = GaugeMetricFamily(
            "b70_runtime_up", "The runtime answers health and probe", labels=["runtime"]
        )
        for name in sorted(self.config.runtimes):
            o = seen.get(name)
            serving = o is not None and o.active_state == "active"
            active.add_metric([name], float(serving))
            up.add_metric([name], float(serving and o is not None and o.healthy))
        yield active
        yield up
        yield GaugeMetricFamily(
            "b70_proxy_up", "The proxy answers /health/liveliness", value=float(s["proxy_up"])
        )
        unit_active = GaugeMetricFamily(
            "b70_unit_active", "1 when the unit is active", labels=["unit"]
        )
        restarts = CounterMetricFamily(
            "b70_runtime_restarts", "Runtime restarts", labels=["runtime", "by"]
        )
        for unit, st in sorted(s["units"].items()):
            unit_active.add_metric([unit], float(st.active_state == "active"))
        for name, rt in sorted(self.config.runtimes.items()):
            restarts.add_metric([name, "systemd"], float(s["units"][rt.unit].n_restarts or 0))
            mine = s["watched"].get(name)
            by_monitor = mine.restarts_by_monitor if mine is not None else 0
            restarts.add_metric([name, "monitor"], float(by_monitor))
        yield unit_active
        yield restarts
        yield CounterMetricFamily(
            "b70_failovers", "Failovers to the fallback runtime", value=float(s["m"].failovers)
        )

    def _switches(self, s: dict[str, Any]) -> Iterator[Any]:
        yield CounterMetricFamily("b70_switches", "Switches recorded", value=float(s["switches"]))
        yield CounterMetricFamily(
            "b70_switches_failed", "Switches that failed", value=float(s["switches_failed"])
        )
        last = s["last_switch"]
        if last is None:
            return
        if isinstance(last.get("seconds"), int | float):
            yield GaugeMetricFamily(
                "b70_last_switch_duration_seconds",
                "How long the last switch took",
                value=float(last["seconds"]),
            )
        reason = GaugeMetricFamily(
            "b70_last_switch_reason",
            "1 for why the last switch was made (by hand, failover, demand, starving, idle return)",
            labels=["reason", "to"],
        )
        reason.add_metric([str(last.get("reason", "by hand")), str(last.get("to"))], 1.0)
        yield reason
        phases = GaugeMetricFamily(
            "b70_last_switch_phase_seconds",
            "How long each phase of the last switch took",
            labels=["phase"],
        )
        recorded = last.get("phases")
        for phase, seconds in sorted(recorded.items() if isinstance(recorded, dict) else ()):
            if isinstance(seconds, int | float):
                phases.add_metric([str(phase)], float(seconds))
        yield phases

    def _requests(self, s: dict[str, Any]) -> Iterator[Any]:
        held = s["held"]
        in_flight = GaugeMetricFamily(
            "b70_requests_in_flight",
            "Running plus waiting requests in the runtime",
            labels=["runtime"],
        )
        for o in s["observed"]:
            if o.in_flight is not None:
                in_flight.add_metric([o.runtime], float(o.in_flight))
        yield in_flight
        yield GaugeMetricFamily(
            "b70_requests_held",
            "Requests waiting at the proxy now (a switch, or the runtime not healthy)",
            value=float(held.now),
        )
        yield CounterMetricFamily(
            "b70_held_requests",
            "Requests that had to wait at the proxy, since the proxy started",
            value=float(held.total),
        )
        yield CounterMetricFamily(
            "b70_hold_timeouts",
            "Held requests answered 503 because the hold time ran out, since the proxy started",
            value=float(held.timed_out),
        )

    def _demand(self, s: dict[str, Any]) -> Iterator[Any]:
        """The switch on demand: its queues, why switches were made, the pin, refusals."""
        d = s["demand"]
        by_reason = CounterMetricFamily(
            "b70_switches_by_reason",
            "Switches recorded, by why: by hand, failover, demand, starving, idle return",
            labels=["reason"],
        )
        for reason, n in sorted(s["reasons"].items()):
            by_reason.add_metric([reason], float(n))
        yield by_reason
        waiting = GaugeMetricFamily(
            "b70_demand_waiting",
            "Requests waiting at the proxy for a model, and the runtime that serves it",
            labels=["model", "runtime"],
        )
        oldest = GaugeMetricFamily(
            "b70_demand_oldest_wait_seconds",
            "How long the oldest request waiting for a model has waited",
            labels=["model", "runtime"],
        )
        for q in d["queues"]:
            labels = [str(q["model"]), str(q["runtime"])]
            waiting.add_metric(labels, float(q["waiting"]))
            oldest.add_metric(labels, float(q["oldest_s"]))
        yield waiting
        yield oldest
        pin = GaugeMetricFamily(
            "b70_pin_seconds", "How long the pin on a runtime still holds", labels=["runtime"]
        )
        if d["pin"] is not None:
            pin.add_metric([d["pin"]["runtime"]], float(d["pin"]["left_s"]))
        yield pin
        refused = GaugeMetricFamily(
            "b70_demand_refused_seconds",
            "How long a runtime that failed to start on demand is still not tried",
            labels=["runtime"],
        )
        for r in d["refused"]:
            refused.add_metric([str(r.get("runtime"))], float(r["left_s"]))
        yield refused

    def _keys(self, s: dict[str, Any]) -> Iterator[Any]:
        """Who used what, per key name (`b70ctl keys`; the master key is "master"), since the
        usage files began (31 days are kept)."""
        families = {
            "requests": CounterMetricFamily(
                "b70_key_requests", "Requests to the model, per key", labels=["key"]
            ),
            "tokens": CounterMetricFamily(
                "b70_key_tokens",
                "Tokens in and out as the runtimes counted them, per key",
                labels=["key", "direction"],
            ),
            "queued": CounterMetricFamily(
                "b70_key_queued_seconds",
                "Time requests waited at the door, per key",
                labels=["key"],
            ),
            "limited": CounterMetricFamily(
                "b70_key_limited", "Requests refused 429 by their key's limits", labels=["key"]
            ),
        }
        for name, use in sorted(s.get("keys", {}).items()):
            families["requests"].add_metric([name], float(use.requests))
            families["tokens"].add_metric([name, "in"], float(use.tokens_in))
            families["tokens"].add_metric([name, "out"], float(use.tokens_out))
            families["queued"].add_metric([name], use.queued_s)
            families["limited"].add_metric([name], float(use.limited))
        yield from families.values()

    def _vram(self, s: dict[str, Any]) -> Iterator[Any]:
        total = GaugeMetricFamily("b70_vram_total_bytes", "GPU memory", labels=["device"])
        used = GaugeMetricFamily("b70_vram_used_bytes", "GPU memory in use", labels=["device"])
        per_unit = GaugeMetricFamily(
            "b70_vram_unit_bytes", "GPU memory held per unit", labels=["device", "unit"]
        )
        for mem in s["gpu"].devices:
            slot = mem.device.pci_slot
            if mem.total_bytes is not None:
                total.add_metric([slot], float(mem.total_bytes))
            if mem.used_bytes is not None:
                used.add_metric([slot], float(mem.used_bytes))
            by_unit: dict[str, int] = {}
            for holder, held in mem.holders:
                by_unit[holder.unit or ""] = by_unit.get(holder.unit or "", 0) + held
            for unit, held in sorted(by_unit.items()):
                per_unit.add_metric([slot, unit], float(held))
        yield total
        yield used
        yield per_unit
