"""The monitor: its record across restarts, and b70-monitor.service on the real stack (its
policy is tested in tests/test_plans.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance import hold
from appliance.proxy import waiting
from appliance.switch.plans import Memory
from appliance.watch.monitor import restore, save
from tests.conftest import (
    GGUF,
    LLAMA_SERVER,
    Appliance,
    demo_config_text,
    free_port,
    installed,
    live_pid,
    require_real_parts,
    running_manager,
)


def test_counters_survive_a_restart_of_the_monitor(tmp_path: Path) -> None:
    m = Memory(failures=2, restarts_by_monitor=3, failovers=1, hold_until=time.time() + 60)
    m.last_action = {"what": "restart", "runtime": "llamacpp", "reason": "hung", "result": "ok"}
    save(tmp_path, m, None)
    again = restore(tmp_path)
    assert (again.restarts_by_monitor, again.failovers, again.last_action) == (3, 1, m.last_action)
    # What it was in the middle of starts afresh.
    assert again.failures == 0 and again.hold_until == 0.0
    (tmp_path / "monitor.json").write_text('{"restarts_by_monitor": "x", "failovers": true}')
    assert (restore(tmp_path).restarts_by_monitor, restore(tmp_path).failovers) == (0, 0)


# --- b70-monitor.service on the real stack -----------------------------------------------------


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Appliance, Path, int]]:
    require_real_parts()
    root = tmp_path_factory.mktemp("monitor")
    model = root / "flaky.gguf"
    shutil.copy(GGUF, model)
    metrics_port = free_port()
    extra = f"""
[runtimes.flaky]
engine = "llamacpp"
command = ["{LLAMA_SERVER}"]
model = "{model}"
start_timeout_s = 60
args = ["-c", "1024"]

[monitor]
port = {metrics_port}
interval_s = 1
health_timeout_s = 1
probe_timeout_s = 10
hang_after = 2
restart_tries = 1
fallback = "llamacpp"
"""
    text = demo_config_text(free_port(), free_port(), extra).replace(
        'default_runtime = "llamacpp"', 'default_runtime = "flaky"'
    )
    with running_manager(root / "manager") as manager:
        cfg = root / "appliance.toml"
        cfg.write_text(text)
        proxy_port = int(text.split("port = ", 1)[1].split("\n", 1)[0])
        backend_port = int(text.split("[backend]", 1)[1].split("port = ", 1)[1].split("\n", 1)[0])
        with installed(manager, cfg, proxy_port, backend_port) as app:
            yield app, model, metrics_port


def main_pid(app: Appliance, unit: str) -> int:
    return int(app.manager.systemctl("show", "-p", "MainPID", "--value", unit).strip() or 0)


def wait_for(predicate, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if predicate():
                return time.monotonic() - start
        except (httpx.HTTPError, OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


FLAKY_UP = ("b70_runtime_up", (("runtime", "flaky"),))  # the watched runtime answers


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_match_what_the_monitor_knows(watched: tuple[Appliance, Path, int]) -> None:
    app, _, port = watched
    wait_for(lambda: scrape(port).get(FLAKY_UP) == 1.0, 30, "a healthy sample")
    m = scrape(port)
    assert m[("b70_active_runtime", (("runtime", "flaky"),))] == 1.0
    assert m[("b70_active_runtime", (("runtime", "llamacpp"),))] == 0.0
    assert m[("b70_proxy_up", ())] == 1.0
    assert m[("b70_unit_active", (("unit", "b70-flaky.service"),))] == 1.0
    assert m[("b70_unit_active", (("unit", "b70-vllm.service"),))] == 0.0
    history = Path(app.manager.env["XDG_STATE_HOME"]) / "b70" / "switches.jsonl"
    switches = len(history.read_text().splitlines()) if history.exists() else 0
    assert m[("b70_switches_total", ())] == switches
    assert m[("b70_requests_in_flight", (("runtime", "flaky"),))] == 0.0
    assert m[("b70_runtime_up", (("runtime", "llamacpp"),))] == 0.0
    assert m[("b70_requests_held", ())] == 0.0
    held = hold.read_counts(Path(app.manager.env["XDG_STATE_HOME"]) / "b70")
    assert m[("b70_held_requests_total", ())] == held.total
    assert m[("b70_hold_timeouts_total", ())] == held.timed_out == 0
    assert m[("b70_failovers_total", ())] == 0.0


def test_kill_9_is_restarted_by_systemd_and_a_request_waits_for_it(
    watched: tuple[Appliance, Path, int],
) -> None:
    app, _, port = watched
    held_before = scrape(port).get(("b70_held_requests_total", ()), 0.0)
    before = live_pid(app, "b70-flaky.service")
    start = time.monotonic()
    os.kill(before, signal.SIGKILL)
    # The hook trusts a healthy answer for HEALTH_TTL_S: a request sent later is held, not failed.
    time.sleep(waiting.HEALTH_TTL_S + 0.1)
    assert app.ask().strip()
    took = time.monotonic() - start
    print(f"\nkill -9 -> a request sent right after was answered after {took:.1f} s")
    assert main_pid(app, "b70-flaky.service") not in (0, before)
    assert took > 5, "RestartSec=5s: the answer can only come from the restarted runtime"
    assert app.json("status")["result"]["active_runtime"] == "flaky"
    wait_for(
        lambda: scrape(port)[("b70_held_requests_total", ())] >= held_before + 1,
        10,
        "the held request in the metrics",
    )
    # The sample that first counts it may have been taken while it waited; the next one not.
    wait_for(lambda: scrape(port)[("b70_requests_held", ())] == 0.0, 10, "no request held any more")


def test_a_hang_is_detected_and_restarted(watched: tuple[Appliance, Path, int]) -> None:
    app, _, port = watched
    wait_for(lambda: scrape(port).get(FLAKY_UP) == 1.0, 30, "a healthy sample")
    before = live_pid(app, "b70-flaky.service")
    os.kill(before, signal.SIGSTOP)
    try:
        took = wait_for(
            lambda: main_pid(app, "b70-flaky.service") not in (0, before),
            60,
            "a restart of the hung runtime",
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before, signal.SIGCONT)
    print(f"\nSIGSTOP -> restarted by the monitor after {took:.1f} s")
    assert took < 30
    wait_for(lambda: app.ask().strip(), 60, "serving again")
    monitor = app.json("status")["result"]["monitor"]
    assert (
        monitor["last_action"]["what"] == "restart" and monitor["last_action"]["runtime"] == "flaky"
    )
    assert monitor["last_action"]["reason"].startswith("hung: ")
    assert monitor["restarts_by_monitor"] >= 1
    by_monitor = ("b70_runtime_restarts_total", (("by", "monitor"), ("runtime", "flaky")))
    wait_for(lambda: scrape(port).get(by_monitor, 0.0) >= 1.0, 10, "the runtime's own restarts")
    human = app.b70ctl("status").stdout
    assert "last action   restart flaky: hung: " in human


def test_the_monitor_killed_while_it_restarts_a_runtime(
    watched: tuple[Appliance, Path, int],
) -> None:
    """systemd finishes the restart the monitor asked for; systemd restarts the monitor, which
    keeps its count."""
    app, _, port = watched
    app.manager.systemctl("reset-failed", "b70-flaky.service")  # the start limit counts anew
    wait_for(lambda: scrape(port).get(FLAKY_UP) == 1.0, 30, "a healthy sample")
    counted = app.json("status")["result"]["monitor"]["restarts_by_monitor"]
    runtime, monitor = live_pid(app, "b70-flaky.service"), live_pid(app, "b70-monitor.service")
    os.kill(runtime, signal.SIGSTOP)
    try:
        wait_for(
            lambda: (
                app.manager.systemctl("show", "-p", "ActiveState", "--value", "b70-flaky").strip()
                != "active"
            ),
            60,
            "the monitor's restart of the hung runtime",
        )
        os.kill(monitor, signal.SIGKILL)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(runtime, signal.SIGCONT)
    wait_for(lambda: main_pid(app, "b70-flaky.service") not in (0, runtime), 60, "a new runtime")
    wait_for(lambda: app.ask().strip(), 60, "serving again")
    wait_for(lambda: main_pid(app, "b70-monitor.service") not in (0, monitor), 30, "a new monitor")
    wait_for(lambda: scrape(port).get(FLAKY_UP) == 1.0, 30, "the new monitor sampling")
    status = app.json("status")["result"]
    assert status["monitor"]["restarts_by_monitor"] == counted + 1
    assert status["active_runtime"] == "flaky"


def test_a_runtime_that_cannot_come_back_fails_over(watched: tuple[Appliance, Path, int]) -> None:
    app, model, port = watched
    app.manager.systemctl("reset-failed", "b70-flaky.service")  # the start limit counts anew
    wait_for(lambda: app.json("status")["result"]["active_runtime"] == "flaky", 60, "flaky serving")
    model.write_bytes(b"GGUF" + b"\0" * 64)  # its next start fails
    os.kill(live_pid(app, "b70-flaky.service"), signal.SIGKILL)
    took = wait_for(
        lambda: app.json("status")["result"]["active_runtime"] == "llamacpp", 120, "failover"
    )
    print(f"\nunrecoverable runtime -> failover to llamacpp after {took:.1f} s")
    assert app.ask().strip()
    monitor = app.json("status")["result"]["monitor"]
    assert (
        monitor["last_action"]["what"] == "failover"
        and monitor["last_action"]["runtime"] == "llamacpp"
    )
    assert monitor["last_action"]["result"] == "llamacpp is serving"
    assert "flaky" in monitor["last_action"]["reason"]
    wait_for(
        lambda: scrape(port).get(("b70_failovers_total", ())) == 1.0, 10, "the failover metric"
    )
    record = json.loads(
        (Path(app.manager.env["XDG_STATE_HOME"]) / "b70" / "last-switch.json").read_text()
    )
    assert record["to"] == "llamacpp" and record["ok"]
