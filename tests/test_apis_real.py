"""Every client of tests/clientkit.py at once, each in a loop through :8000, while the runtime is
switched away and back (llama.cpp to a second llama.cpp runtime, both with embeddings): no call
fails, and every client has a call under way during a switch. The same clients against each demo
runtime are in tests/test_door_real.py; OpenAI Responses and Anthropic Messages streams across a
switch to vLLM and back are in tests/test_load_real.py."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from b70tools.net import free_port
from tests import clientkit
from tests.conftest import (
    CACHE,
    SECOND_LLAMACPP,
    Appliance,
    demo_config_text,
    installed,
    require_real_parts,
    running_manager,
)


def test_every_client_goes_on_through_switches_without_a_failure(
    appliance: Appliance, tmp_path: Path
) -> None:
    appliance.b70ctl("switch", "llamacpp", check=True)
    door = clientkit.Door(appliance.proxy_port, appliance.key, tmp_path)
    speakers = [*clientkit.GENERATING, *clientkit.EMBEDDING]
    calls: dict[str, list[tuple[float, float]]] = {s.__name__: [] for s in speakers}
    failures: list[str] = []
    stop = threading.Event()

    def loop(speak: Callable[[clientkit.Door], str]) -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                speak(door)
            except Exception as e:  # every failure is reported, whatever its kind
                failures.append(f"{speak.__name__}: {type(e).__name__}: {e}")
            else:
                calls[speak.__name__].append((start, time.monotonic()))

    threads = [threading.Thread(target=loop, args=(s,), daemon=True) for s in speakers]
    for thread in threads:
        thread.start()
    switches: list[tuple[float, float]] = []
    try:
        time.sleep(3)
        for runtime in ("llamacpp-b", "llamacpp"):
            start = time.monotonic()
            appliance.b70ctl("switch", runtime, check=True)
            switches.append((start, time.monotonic()))
            time.sleep(2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
    assert failures == [], failures
    across = {
        name
        for name, spans in calls.items()
        for start, end in spans
        if any(start < s_end and end > s_start for s_start, s_end in switches)
    }
    assert across == set(calls), f"no call during a switch: {set(calls) - across}"
    print(
        "\n"
        + ", ".join(f"{name} {len(spans)}" for name, spans in calls.items())
        + f"; switches took {', '.join(f'{e - s:.1f} s' for s, e in switches)}"
    )


def test_status_says_which_apis_each_runtime_speaks(appliance: Appliance) -> None:
    units = {u["unit"]: u for u in appliance.json("status")["result"]["units"]}
    generative = ["chat.completions", "completions", "responses", "messages"]
    assert units["b70-llamacpp.service"]["apis"] == [*generative, "embeddings", "tokenize"]
    assert units["b70-vllm.service"]["apis"] == [*generative, "tokenize"]
    text = appliance.b70ctl("status").stdout
    assert "b70-vllm.service: chat.completions completions responses messages tokenize" in text


CODEX = CACHE / "codex-0.171.0" / "node_modules" / ".bin" / "codex"
# The demo's llama.cpp with one slot of 16384 tokens: Codex's first request is about 9900 tokens
# of SmolLM2's (its tools and instructions, 40 KB), more than the demo's 2048. It asks for no
# most tokens of an answer, so llama-server's own -n caps them: the switch's drain (60 s) waits
# for a whole answer.
LONG = ('"-c", "2048", "--parallel", "2"', '"-c", "16384", "--parallel", "1", "-n", "48"')


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    require_real_parts()
    assert CODEX.exists(), f"{CODEX} is missing: run scripts/fetch-codex"
    root = tmp_path_factory.mktemp("long")
    proxy_port, backend_port = free_port(), free_port()
    with running_manager(root / "manager") as manager:
        config = root / "appliance.toml"
        text = demo_config_text(proxy_port, backend_port, SECOND_LLAMACPP)
        config.write_text(text.replace(*LONG))  # both llama.cpp runtimes
        with installed(manager, config, proxy_port, backend_port) as app:
            yield app


def test_a_coding_agent_works_through_8000_across_a_switch(
    long_context: Appliance, tmp_path: Path
) -> None:
    """`codex exec PROMPT` with the appliance as its model provider (wire_api "responses"), its
    Responses stream read by its own client; a switch to another runtime while it waits for its
    answer is drained, so its turn still ends."""
    app = long_context
    provider = (
        f'model_providers.b70={{name="b70",base_url="http://127.0.0.1:{app.proxy_port}/v1",'
        'env_key="B70_KEY",wire_api="responses"}'
    )
    argv = [str(CODEX), "exec", "--skip-git-repo-check", "-c", "model_provider=b70",
            "-c", provider, "-m", "smollm2", "Say hi in five words."]  # fmt: skip
    env = {**os.environ, "B70_KEY": app.key, "CODEX_HOME": str(tmp_path / "codex")}
    (tmp_path / "codex").mkdir()
    start = time.monotonic()
    agent = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        time.sleep(3)  # its request is with the runtime (its prompt alone is some seconds)
        switched = app.json("switch", "llamacpp-b")
        out, _ = agent.communicate(timeout=300)
    finally:
        agent.kill()
    seconds = time.monotonic() - start
    assert switched["ok"], switched
    assert agent.returncode == 0, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert "codex" in lines and lines[-1] != "codex", out  # its answer follows its name
    assert "ERROR" not in out, out
    print(f"\ncodex exec in {seconds:.1f} s across a switch:\n{out[-400:]}")
