"""The Grafana dashboard asks only for metrics the monitor exports."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest

from appliance import hold, usage
from appliance.config import parse
from appliance.host.gpu import DeviceMemory, Holder, Snapshot
from appliance.host.gpu.sysfs import Device
from appliance.layout import HISTORY
from appliance.switch.demand import pins
from appliance.switch.plans import Memory, Observation
from appliance.watch import metrics
from tests.conftest import REPO

DASHBOARD = REPO / "examples" / "grafana" / "b70-dashboard.json"
# PromQL's own words the dashboard uses; any other name must be a metric or one of its labels.
PROMQL = {"sum", "by", "increase", "changes", "rate", "max", "min", "avg", "without", "and"}
CONFIG = """
default_runtime = "vllm"
[runtimes.vllm]
engine = "vllm"
model = "/m"
[runtimes.llamacpp]
engine = "llamacpp"
model = "/m.gguf"
"""


def queries(doc: Any) -> list[str]:
    """Every `expr` in the dashboard, at any depth (panels, targets, annotations)."""
    if isinstance(doc, dict):
        found = [doc["expr"]] if isinstance(doc.get("expr"), str) else []
        return found + [q for v in doc.values() for q in queries(v)]
    if isinstance(doc, list):
        return [q for v in doc for q in queries(v)]
    return []


def exported(tmp_path: Path) -> tuple[set[str], set[str]]:
    """Sample names and label names of a scrape with every metric present: a monitor that has
    seen a switch, a runtime with requests in flight, a card with a holder, and switching on
    demand with a queue, a pin and a refused runtime."""
    (tmp_path / HISTORY).write_text(
        json.dumps({"ok": True, "seconds": 3.2, "phases": {"unit": 2.5, "verified": 0.4}}) + "\n"
    )
    hold.write_counts(tmp_path, hold.HeldCounts(2, 2, 0), port=8001, oldest=time.time() - 5)
    pins.write_pin(tmp_path, "vllm", 60)
    ledger = usage.Ledger(tmp_path)
    ledger.add("alice", usage.Use(3, 30, 90, 1.5, 1))
    refused = {"runtime": "llamacpp", "until": time.time() + 60, "why": "x"}
    hold.write_demand(tmp_path, {"refused": {"8001": refused}})
    cfg = parse(CONFIG, tmp_path / "appliance.toml")
    exporter = metrics.Exporter(cfg)
    o = Observation(1.0, "vllm", "active", "running", 42, True, "ok", False, in_flight=3)
    unit = SimpleNamespace(active_state="active", n_restarts=1)
    device = Device("0000:03:00.0", 0x8086, 0xE223, "xe", "card1", "renderD128")
    holder = Holder(42, "vllm serve", "b70-vllm.service", {"0000:03:00.0": 2**30})
    snap = Snapshot([DeviceMemory(device, 2**35, 2**31, "xe-query", [(holder, 2**30)])], 0, [])
    units = {u: unit for u in ("b70-vllm.service", "b70-llamacpp.service", "b70-litellm.service")}
    exporter.update([o], Memory(), units, True, snap, tmp_path, {"vllm": Memory()})
    text = generate_latest(exporter.registry).decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    names = {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group() for line in samples}  # type: ignore[union-attr]
    labels = {m for line in samples for m in re.findall(r"([a-zA-Z_]\w*)=\"", line)}
    return names, labels


def test_every_query_names_a_metric_the_monitor_exports(tmp_path: Path) -> None:
    doc = json.loads(DASHBOARD.read_text())
    exprs = queries(doc)
    assert len(exprs) >= 10
    names, labels = exported(tmp_path)
    used = set()
    for expr in exprs:
        # Strip ranges ([1h]) and strings ("...") and keep the words.
        words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r'\[[^]]*\]|"[^"]*"', "", expr)))
        unknown = words - PROMQL - names - labels
        assert not unknown, f"{expr!r} names {sorted(unknown)}, which the monitor does not export"
        used |= words & names
    # The list: serving runtime, VRAM per card and per unit, switch durations, requests
    # held, restarts and failovers.
    for metric in (
        "b70_active_runtime",
        "b70_vram_used_bytes",
        "b70_vram_unit_bytes",
        "b70_last_switch_phase_seconds",
        "b70_requests_held",
        "b70_runtime_restarts_total",
        "b70_failovers_total",
        "b70_key_tokens_total",
        "b70_key_requests_total",
        "b70_key_limited_total",
    ):
        assert metric in used, metric


def test_the_check_catches_a_metric_that_does_not_exist(tmp_path: Path) -> None:
    names, _ = exported(tmp_path)
    assert "b70_vram_used_bytes" in names and "b70_switches_total" in names
    assert "b70_switches" not in names  # a counter is exported with _total
    assert "b70_vram_free_bytes" not in names
