"""The switch on real parts: a systemd user manager, llama-server and vLLM on the CPU, the LiteLLM
proxy, SmolLM2, and the OpenAI SDK as the client."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.conftest import Appliance

RUNTIME_UNITS = [
    "b70-broken.service",
    "b70-llamacpp.service",
    "b70-llamacpp-b.service",
    "b70-vllm.service",
]


class ExclusionSampler(threading.Thread):
    """Samples every runtime unit's ActiveState; two units away from inactive at once is a
    violation."""

    def __init__(self, app: Appliance) -> None:
        super().__init__(daemon=True)
        self.app = app
        self.samples = 0
        self.violations: list[dict[str, str]] = []
        self.seen: set[str] = set()
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            # One call that the manager answers whole (`show` asks unit by unit, so a stop
            # that ends between its two questions read as an overlap under load: CI, session 24)
            out = self.app.manager.systemctl(
                "list-units", "--all", "--plain", "--no-legend", "--full", *RUNTIME_UNITS
            )
            active = {u: "inactive" for u in RUNTIME_UNITS}  # a unit not loaded is not listed
            for line in out.splitlines():
                words = line.removeprefix("●").split()  # the mark of a failed unit, if shown
                if len(words) >= 3 and words[0] in active:
                    active[words[0]] = words[2]  # UNIT LOAD ACTIVE SUB DESCRIPTION
            busy = {u: s for u, s in active.items() if s not in {"inactive", "failed"}}
            self.seen |= {f"{u}={s}" for u, s in active.items()}
            if len(busy) > 1:
                self.violations.append(busy)
            self.samples += 1
            time.sleep(0.05)

    def stop(self) -> None:
        self.stop_event.set()
        self.join()


def backend_healthy(app: Appliance) -> bool:
    try:
        return (
            httpx.get(f"http://127.0.0.1:{app.backend_port}/health", timeout=5).status_code == 200
        )
    except httpx.HTTPError:
        return False


def test_install_started_the_default_runtime_behind_the_proxy(appliance: Appliance) -> None:
    status = appliance.json("status")["result"]
    assert status["active_runtime"] == "llamacpp"
    assert status["proxy"]["healthy"] and status["backend"]["healthy"]
    units = {u["unit"]: u for u in status["units"]}
    assert units["b70-llamacpp.service"]["enabled"] == "enabled"
    assert units["b70-litellm.service"]["enabled"] == "enabled"
    assert units["b70-vllm.service"]["enabled"] == "disabled"
    assert appliance.ask().strip()


def test_round_trip_llamacpp_vllm_llamacpp(appliance: Appliance) -> None:
    appliance.b70ctl("switch", "llamacpp", check=True)
    before = appliance.ask()
    sampler = ExclusionSampler(appliance)
    sampler.start()
    try:
        first = start_switch(appliance, "vllm")
        # A second switch while the first one runs is refused and names the first.
        note = Path(appliance.manager.env["XDG_STATE_HOME"]) / "b70" / "switch.json"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not note.exists():
            time.sleep(0.05)
        second = appliance.b70ctl("switch", "llamacpp")
        assert second.returncode == 3, second.stderr
        assert "another switch is running: to vllm (pid" in second.stderr
        out, err = first.communicate(timeout=900)
        assert first.returncode == 0, err
        to_vllm = json.loads(out)["result"]
        assert to_vllm["ok"] and to_vllm["previous"] == "llamacpp" and to_vllm["target"] == "vllm"
        assert appliance.json("status")["result"]["active_runtime"] == "vllm"
        assert appliance.manager.systemctl("is-active", "b70-vllm.service").strip() == "active"
        assert backend_healthy(appliance)
        on_vllm = appliance.ask()

        back = appliance.json("switch", "llamacpp")
        assert back["ok"], back
        after = appliance.ask()
    finally:
        sampler.stop()
    assert sampler.violations == []
    assert sampler.samples > 20
    # The sampler saw the switch happen, not only its ends.
    assert "b70-vllm.service=activating" in sampler.seen
    assert (
        "b70-llamacpp.service=deactivating" in sampler.seen
        or "b70-vllm.service=deactivating" in sampler.seen
    )
    assert before.strip() and on_vllm.strip()
    assert after == before, "the same greedy prompt must get the same answer from llama.cpp again"
    status = appliance.json("status")["result"]
    assert status["active_runtime"] == "llamacpp"
    assert status["last_switch"]["from"] == "vllm" and status["last_switch"]["to"] == "llamacpp"
    enabled = {u["unit"]: u["enabled"] for u in status["units"]}
    assert (
        enabled["b70-llamacpp.service"] == "enabled" and enabled["b70-vllm.service"] == "disabled"
    )


def test_rollback_when_the_target_cannot_start(appliance: Appliance) -> None:
    appliance.b70ctl("switch", "llamacpp", check=True)
    out = appliance.b70ctl("switch", "broken")
    assert out.returncode != 0
    assert "switch to broken failed" in out.stderr
    assert "rolled back: llamacpp is serving again" in out.stderr
    status = appliance.json("status")["result"]
    assert status["active_runtime"] == "llamacpp"
    assert status["last_switch"]["ok"] is False and status["last_switch"]["rolled_back"] is True
    assert appliance.ask().strip()
    enabled = {u["unit"]: u["enabled"] for u in status["units"]}
    assert (
        enabled["b70-broken.service"] == "disabled" and enabled["b70-llamacpp.service"] == "enabled"
    )


def test_switch_json_error_is_one_document(appliance: Appliance) -> None:
    out = appliance.b70ctl("switch", "nosuch", "--json")
    assert out.returncode == 2
    doc = json.loads(out.stdout)
    assert doc["ok"] is False and doc["error"]["code"] == "config_invalid"
    assert "no runtime named 'nosuch'" in doc["error"]["message"]


def test_the_master_key_is_never_in_a_unit_or_a_log(appliance: Appliance) -> None:
    key = appliance.key
    assert key.startswith("sk-")
    config_home = Path(appliance.manager.env["XDG_CONFIG_HOME"])
    key_file = config_home / "b70" / "proxy.env"
    assert key_file.stat().st_mode & 0o777 == 0o600
    for path in (config_home / "systemd" / "user").glob("b70-*.service"):
        assert key not in path.read_text()
    assert key not in (config_home / "b70" / "litellm.yaml").read_text()
    logs = appliance.b70ctl("logs", "proxy", "-n", "1000")
    assert logs.returncode == 0 and "b70-litellm" in logs.stdout
    assert key not in logs.stdout


def test_logs_show_the_runtime_journal(appliance: Appliance) -> None:
    out = appliance.b70ctl("logs", "llamacpp", "-n", "200")
    assert out.returncode == 0
    assert "healthy after" in out.stdout  # written by the unit's health guard (ExecStartPost=)


def appliance_argv(app: Appliance) -> list[str]:
    from tests.conftest import B70CTL

    return [B70CTL, "--user", "--config", str(app.config)]


def start_switch(app: Appliance, *args: str) -> subprocess.Popen[str]:
    """`b70ctl switch ARGS --json` running in the background."""
    return subprocess.Popen(
        [*appliance_argv(app), "switch", *args, "--json"],
        env=app.manager.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_foreign_gpu_holder_is_named_and_the_switch_refused(
    appliance: Appliance, tmp_path: Path
) -> None:
    from b70tools import gpu_trees as t

    appliance.b70ctl("switch", "llamacpp", check=True)
    before = appliance.json("status")["result"]["units"]
    tree = t.build(
        tmp_path / "root",
        [t.Card(t.B70, vram_used=31 * t.GIB + 700 * 1024**2)],
        [t.foreign(resident="31 GiB")],
    )
    env = dict(appliance.manager.env, B70_SYSROOT=str(tree))
    out = subprocess.run(
        [*appliance_argv(appliance), "switch", "vllm"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 1
    assert (
        "error: vllm would not have enough GPU memory: 0000:03:00.0: only 0.3 GiB of 32.0 GiB"
        in out.stderr
    )
    assert "pid 5151 (python3 train.py --epochs 3) in session-3.scope: 31.0 GiB" in out.stderr
    after = appliance.json("status")["result"]["units"]
    assert [(u["unit"], u["active"], u["main_pid"]) for u in after] == [
        (u["unit"], u["active"], u["main_pid"]) for u in before
    ]


def long_stream(app: Appliance, max_tokens: int) -> Iterator[Any]:
    """A streaming request that keeps llama-server busy for a while; its first chunk is read."""
    stream = app.story(max_tokens=max_tokens)
    chunks = iter(stream)
    next(chunks)
    return chunks


def test_without_the_drain_llama_server_cuts_the_stream_in_flight(appliance: Appliance) -> None:
    """Why the drain exists: `--drain-timeout 0` restarts llama-server under a running stream."""
    appliance.b70ctl("switch", "llamacpp", check=True)
    chunks = long_stream(appliance, max_tokens=300)
    switch = appliance.b70ctl("switch", "llamacpp", "--restart", "--drain-timeout", "0", "--json")
    assert switch.returncode == 0, switch.stderr
    assert "still in flight after 0 s" in " ".join(json.loads(switch.stdout)["result"]["notes"])
    finish = []
    with contextlib.suppress(openai.APIError, httpx.HTTPError):
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert "length" not in finish


def test_a_restart_drains_the_stream_in_flight_and_holds_the_next_request(
    appliance: Appliance,
) -> None:
    """llama-server cuts every request in flight on SIGTERM: only the drain saves this stream."""
    appliance.b70ctl("switch", "llamacpp", check=True)
    stream = appliance.story()
    chunks = iter(stream)
    first = next(chunks)  # the runtime is generating now
    switch = start_switch(appliance, "llamacpp", "--restart")
    hold_file = Path(appliance.manager.env["XDG_STATE_HOME"]) / "b70" / "hold.json"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not hold_file.exists():
        time.sleep(0.02)
    assert hold_file.exists(), "the switch never marked the hold"
    held: dict[str, object] = {}

    def late_request() -> None:  # arrives while the switch drains: it must wait, not fail
        start = time.monotonic()
        held["answer"] = appliance.ask("Say yes.")
        held["seconds"] = time.monotonic() - start

    late = threading.Thread(target=late_request)
    late.start()
    rest = list(chunks)
    usage = [c.usage for c in rest if c.usage]
    finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
    out, err = switch.communicate(timeout=300)
    late.join(timeout=300)
    assert switch.returncode == 0, err
    result = json.loads(out)["result"]
    assert [f for f in finish if f] == ["length"], ("the stream was cut", finish[-3:])
    assert usage and usage[-1].completion_tokens == 300
    assert result["phases"]["drained"] > 0.5, result["phases"]
    assert str(held.get("answer", "")).strip(), "the request during the switch got no answer"
    assert float(held["seconds"]) > result["phases"]["drained"] / 2  # type: ignore[arg-type]
    assert not hold_file.exists(), "the hold was not released"
