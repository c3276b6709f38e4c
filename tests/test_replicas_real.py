"""Replicas, for real: four CPU llama-servers, one per card of a fixture tree with four B70s, all
serving `small` through the proxy, where LiteLLM's router spreads the requests. A rolling switch
to another replica set, under 16 OpenAI-SDK clients, replaces them one card at a time: no
request fails, no stream is cut, and at least three replicas serve all along."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from b70tools import load_test
from b70tools.net import free_port
from tests.conftest import (
    B70CTL,
    GGUF,
    LLAMA_SERVER,
    Appliance,
    appliance_on_cards,
    llamacpp_counter,
)

SLOTS = ["0000:03:00.0", "0000:04:00.0", "0000:07:00.0", "0000:08:00.0"]


def config_text(proxy: int, backend: int, monitor: int) -> str:
    def replicas(name: str, context: int) -> str:
        return f"""
[runtimes.{name}]
engine = "llamacpp"
command = ["{LLAMA_SERVER}"]
model = "{GGUF}"
cards = [0, 1, 2, 3]
per_card = true
start_timeout_s = 120
args = ["-c", "{context}", "--parallel", "4", "--threads", "1"]
"""

    return (
        f"""default_runtime = "old"

[proxy]
port = {proxy}
model = "small"
hold_s = 120

[backend]
port = {backend}

[gpu]
cards = {json.dumps(SLOTS)}

[monitor]
port = {monitor}
probe_completion = false
"""
        + replicas("old", 2048)
        + replicas("new", 4096)
    )


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    root = tmp_path_factory.mktemp("replicas")
    monitor = free_port()
    with appliance_on_cards(root, SLOTS, lambda p, b: config_text(p, b, monitor)) as appliance:
        yield appliance
    shutil.rmtree(root, ignore_errors=True)  # after the manager's stop, which reads its files


def prompt_tokens(port: int) -> float:
    return llamacpp_counter(port, "prompt_tokens_total")


def test_install_starts_every_replica_and_the_router_spreads_requests(app: Appliance) -> None:
    status = app.json("status")["result"]
    assert status["active_runtimes"] == ["old-0", "old-1", "old-2", "old-3"]
    ports = [app.backend_port + i for i in range(4)]
    before = [prompt_tokens(port) for port in ports]
    client = app.client()
    for _ in range(24):
        reply = client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, timeout=60
        )
        assert reply.choices[0].finish_reason
    after = [prompt_tokens(port) for port in ports]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_a_rolling_switch_under_sixteen_clients_loses_nothing_and_keeps_three_serving(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("B70_SYSROOT", app.manager.env["B70_SYSROOT"])  # for b70ctl switch
    target = load_test.Target(
        f"http://127.0.0.1:{app.proxy_port}",
        app.key,
        "small",
        [B70CTL, "--user", "--config", str(app.config)],
    )
    state_dir = Path(app.manager.env["XDG_STATE_HOME"]) / "b70"
    ports = {f"b70-{s}-{i}.service": app.backend_port + i for s in ("old", "new") for i in range(4)}
    replicas = load_test.Replicas(ports, True, state_dir)
    report = asyncio.run(
        load_test.run(
            target, clients=16, switches=2, between=("old", "new"), steady_s=5,
            log=print, replicas=replicas,
        )
    )  # fmt: skip
    s = report.summary()
    print(load_test.render_summary(s))
    assert s["switches_failed"] == 0, s["switches"]
    assert s["all"]["failed"] == 0, s["errors"]
    assert s["all"]["truncated"] == 0, s["errors"]
    assert s["during_switches"]["succeeded"] >= 32
    assert s["capacity"]["samples"] >= 10 and s["capacity"]["lowest"] >= 3, s["capacity"]
    assert app.json("status")["result"]["active_runtimes"] == ["old-0", "old-1", "old-2", "old-3"]
