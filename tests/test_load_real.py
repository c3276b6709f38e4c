"""The load test of scripts/load-test, small, on the real stack: clients on the proxy never see
an error, neither under steady load nor while the runtime is switched back and forth."""

from __future__ import annotations

import asyncio
import sys

from tests.conftest import B70CTL, REPO, Appliance


def load_test_module():  # type: ignore[no-untyped-def]
    from b70tools import load_test

    return load_test


def load_target(lt, appliance: Appliance):  # type: ignore[no-untyped-def]
    """The test appliance as b70tools.load_test addresses an installed one, its proxy up: systemd
    starts the proxy on the first connection to its socket, and that start (LiteLLM's import,
    seconds, longer on a busy machine) must not count against the load test's steady phase."""
    assert appliance.ask().strip()
    return lt.Target(
        f"http://127.0.0.1:{appliance.proxy_port}",
        appliance.key,
        "smollm2",
        [B70CTL, "--user", "--config", str(appliance.config)],
    )


# OpenAI chat and completions, OpenAI Responses and Anthropic Messages, streamed and not
MIX = ("chat-stream", "responses-stream", "messages-stream", "chat", "completion-stream",
       "responses-stream", "messages-stream", "completion")  # fmt: skip


def test_eight_clients_two_switches_no_failed_request_no_truncated_stream(
    appliance: Appliance,
) -> None:
    lt = load_test_module()
    target = load_target(lt, appliance)
    report = asyncio.run(
        lt.run(
            target,
            clients=8,
            switches=2,
            between=("llamacpp", "vllm"),
            steady_s=20,
            log=print,
            steady_min=8,
            kinds=MIX,
        )
    )
    s = report.summary()
    print(lt.render_summary(s))
    assert s["switches_failed"] == 0, s["switches"]
    # Each API's streams, through each SDK's own helper, ran across the switches and finished.
    across = {
        o.kind for o in report.outcomes if report.during_switch(o) and o.result == "succeeded"
    }
    assert {"responses-stream", "messages-stream", "chat-stream"} <= across, across
    assert s["all"]["failed"] == 0, s["errors"]
    assert s["all"]["truncated"] == 0, s["errors"]
    # The test proves something only if requests really overlapped the switches and ran before.
    assert s["steady_phase"]["succeeded"] >= 8
    assert s["during_switches"]["succeeded"] >= 8
    assert [sw["target"] for sw in s["switches"]] == ["vllm", "llamacpp"]


def test_sixteen_streams_of_steady_load_without_a_single_error(appliance: Appliance) -> None:
    """Plain LiteLLM 1.106 in front of llama-server failed now and then at 16 concurrent
    streams, reusing a connection the runtime had closed. Here it must not."""
    lt = load_test_module()
    target = load_target(lt, appliance)
    report = asyncio.run(
        lt.run(
            target,
            clients=16,
            switches=0,
            between=("llamacpp", "vllm"),
            steady_s=20,
            steady_min=16,
        )
    )
    s = report.summary()
    print(lt.render_summary(s))
    if s["all"]["failed"] or s["all"]["truncated"]:
        print(appliance.b70ctl("logs", "proxy", "-n", "80").stdout)
    assert s["all"]["failed"] == 0, s["errors"]
    assert s["all"]["truncated"] == 0, s["errors"]
    assert s["steady_phase"]["succeeded"] >= 16


def test_a_short_soak_samples_every_part_and_loses_no_request(appliance: Appliance) -> None:
    """scripts/soak, shortened: load with switches, and RSS and fds of every part sampled."""
    import json
    import subprocess

    out = subprocess.run(
        [
            *(sys.executable, "-m", "b70tools.soak", "--user"),
            *("--config", str(appliance.config), "--minutes", "0.9", "--switch-every", "0.3"),
            *("--between", "llamacpp", "llamacpp-b"),
            *("--clients", "4", "--sample-s", "2", "--warmup-s", "10", "--max-growth", "0.5"),
            "--json",
        ],
        env=appliance.manager.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr + out.stdout[-2000:]
    doc = json.loads(out.stdout)
    assert doc["requests"]["failed"] == 0 and doc["requests"]["truncated"] == 0
    assert doc["requests"]["succeeded"] >= 20 and doc["switches"] >= 1
    assert doc["switches_failed"] == 0
    samples = doc["samples"]
    assert len(samples) >= 15
    for part in ("proxy", "monitor"):
        assert all(s["rss_bytes"][part] > 0 and s["fds"][part] > 0 for s in samples), part
    # No runtime serves for a moment in each switch, so only what was sampled while one served
    # is checked. The two are llama.cpp runtimes: a vLLM start would be most of so short a run.
    serving = [s for s in samples if s["runtime"]]
    assert all(s["rss_bytes"]["runtime"] > 0 and s["fds"]["runtime"] > 0 for s in serving)
    assert {s["runtime"] for s in serving} == {"llamacpp", "llamacpp-b"}
    # The tests after this one expect the appliance as installed: llama.cpp serving.
    appliance.b70ctl("switch", "llamacpp", check=True)
