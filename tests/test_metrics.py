"""The monitor's metrics describe each runtime, side by side on their own cards or alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import parse
from appliance.host.gpu import Snapshot
from appliance.switch.plans import Memory, Observation
from appliance.watch import metrics

CONFIG = """
default_runtime = "chat"
[gpu]
cards = ["0000:03:00.0", "0000:04:00.0"]
[runtimes.chat]
engine = "llamacpp"
model = "/m.gguf"
cards = [0]
[runtimes.vision]
engine = "llamacpp"
model = "/v.gguf"
cards = [1]
port = 8002
served_model_name = "vision"
[runtimes.spare]
engine = "llamacpp"
model = "/s.gguf"
cards = [0]
"""


def scrape(tmp_path: Path, observed: list[Observation], watched: dict[str, Memory]) -> dict:
    cfg = parse(CONFIG, tmp_path / "appliance.toml")
    exporter = metrics.Exporter(cfg)
    unit = SimpleNamespace(active_state="active", n_restarts=0)
    units = {rt.unit: unit for rt in cfg.runtimes.values()}
    exporter.update(observed, Memory(), units, True, Snapshot([], 0, []), tmp_path, watched)
    text = generate_latest(exporter.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def observation(runtime: str, healthy: bool, in_flight: int | None) -> Observation:
    return Observation(1.0, runtime, "active", "running", 7, healthy, "", False, in_flight)


def test_each_runtime_side_by_side_has_its_own_series(tmp_path: Path) -> None:
    hung = Memory(runtime="vision", restarts_by_monitor=2)
    m = scrape(
        tmp_path,
        [observation("chat", True, 3), observation("vision", False, None)],
        {"chat": Memory(runtime="chat"), "vision": hung},
    )
    assert m[("b70_active_runtime", (("runtime", "chat"),))] == 1.0
    assert m[("b70_active_runtime", (("runtime", "vision"),))] == 1.0
    assert m[("b70_active_runtime", (("runtime", "spare"),))] == 0.0
    assert m[("b70_runtime_up", (("runtime", "chat"),))] == 1.0
    assert m[("b70_runtime_up", (("runtime", "vision"),))] == 0.0
    assert m[("b70_runtime_up", (("runtime", "spare"),))] == 0.0
    assert m[("b70_requests_in_flight", (("runtime", "chat"),))] == 3.0
    assert ("b70_requests_in_flight", (("runtime", "vision"),)) not in m  # it did not say
    assert m[("b70_runtime_restarts_total", (("by", "monitor"), ("runtime", "vision")))] == 2.0
    assert m[("b70_runtime_restarts_total", (("by", "monitor"), ("runtime", "chat")))] == 0.0


def test_no_runtime_serving_says_every_runtime_down(tmp_path: Path) -> None:
    nothing = Observation(1.0, None, None, None, None, False, "no runtime", False)
    m = scrape(tmp_path, [nothing], {})
    for name in ("chat", "vision", "spare"):
        assert m[("b70_active_runtime", (("runtime", name),))] == 0.0
        assert m[("b70_runtime_up", (("runtime", name),))] == 0.0


def test_switching_on_demand_shows_why_each_switch_was_made_the_queue_and_the_pin(
    tmp_path: Path,
) -> None:
    import json

    from appliance import hold
    from appliance.switch.demand import pins

    records = [{"to": "spare", "ok": True, "seconds": 3.0}]  # before switches said why: by hand
    records += [{"to": "chat", "ok": True, "seconds": 4.0, "reason": "demand"}] * 2
    (tmp_path / "switches.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pins.write_pin(tmp_path, "chat", 600)
    refused = {"runtime": "vision", "until": 4e9, "why": "it hung"}
    hold.write_demand(tmp_path, {"refused": {"8002": refused}})
    m = scrape(tmp_path, [observation("chat", True, 0)], {"chat": Memory(runtime="chat")})
    assert m[("b70_switches_by_reason_total", (("reason", "by hand"),))] == 1.0
    assert m[("b70_switches_by_reason_total", (("reason", "demand"),))] == 2.0
    assert m[("b70_last_switch_reason", (("reason", "demand"), ("to", "chat")))] == 1.0
    assert 599 < m[("b70_pin_seconds", (("runtime", "chat"),))] <= 600
    assert m[("b70_demand_refused_seconds", (("runtime", "vision"),))] > 0
