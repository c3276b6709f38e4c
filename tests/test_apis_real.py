"""Every client of tests/clientkit.py at once, each in a loop through :8000, while the runtime is
switched away and back (llama.cpp to a second llama.cpp runtime, both with embeddings): no call
fails, and every client has a call under way during a switch. The same clients against each demo
runtime are in tests/test_door_real.py; OpenAI Responses and Anthropic Messages streams across a
switch to vLLM and back are in tests/test_load_real.py."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import clientkit
from tests.conftest import (
    CACHE,
    SECOND_LLAMACPP,
    Appliance,
    llamacpp_counter,
    own_appliance,
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
# Codex's first request, as it ships, is 40 KB (about 9900 of SmolLM2's tokens): 17.7 KB of its own
# instructions and 18.7 KB of tool schemas. Prefilling that on one CPU thread took over a minute,
# longer than the switch's drain under the suite's load, and the switch cut it. Here Codex speaks
# its own Responses protocol with its shell tools (exec_command, write_stdin) and a one-line
# instruction file: 8.6 KB, about a fifth. The demo's llama.cpp gets one slot of 8192 tokens; Codex
# asks for no most tokens of an answer, so llama-server's own -n caps them, and --ignore-eos makes
# every answer that long. 256 tokens were too few: llama-server answers /metrics only between its
# batches, so the test saw the request in flight after its prompt's one long batch, and once the
# 256 tokens were done before the switch's drain began (2 s later). 512 tokens take several
# times that; the drain may wait 180 s for them.
CODEX_TRIM = ["multi_agent", "apps", "plugins", "image_generation", "view_image", "browser_use",
              "computer_use", "goals", "skill_search", "tool_suggest"]  # fmt: skip
LONG = (
    '"-c", "2048", "--parallel", "2"',
    '"-c", "8192", "--parallel", "1", "-n", "512", "--ignore-eos"',
)
DRAIN = ("hold_s = 120", "hold_s = 300\ndrain_s = 180")


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    assert CODEX.exists(), f"{CODEX} is missing: run scripts/fetch-codex"
    edit = lambda text: text.replace(*LONG).replace(*DRAIN)  # noqa: E731 - both llama.cpps
    with own_appliance(tmp_path_factory.mktemp("long"), SECOND_LLAMACPP, edit) as app:
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
    (tmp_path / "codex").mkdir()
    instructions = tmp_path / "codex" / "instructions.md"
    instructions.write_text("You are a coding agent. Answer briefly.\n")
    trim = [arg for feature in CODEX_TRIM for arg in ("--disable", feature)]
    argv = [str(CODEX), "exec", "--skip-git-repo-check", "-c", "model_provider=b70",
            "-c", provider, "-c", f"model_instructions_file={json.dumps(str(instructions))}",
            *trim, "-m", "smollm2", "Say hi in five words."]  # fmt: skip
    env = {**os.environ, "B70_KEY": app.key, "CODEX_HOME": str(tmp_path / "codex")}
    start = time.monotonic()
    agent = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while llamacpp_counter(app.backend_port, "requests_processing") < 1:  # it asked
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[0]
            time.sleep(0.1)
        switched = app.json("switch", "llamacpp-b")
        out, _ = agent.communicate(timeout=300)
    finally:
        agent.kill()
    seconds = time.monotonic() - start
    assert switched["ok"], switched
    drained = switched["result"]["phases"].get("drained", 0.0)
    assert drained > 0.5, f"the switch found Codex's request already answered: {switched}"
    assert agent.returncode == 0, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert "codex" in lines and lines[-1] != "codex", out  # its answer follows its name
    assert "ERROR" not in out, out
    print(f"\ncodex exec in {seconds:.1f} s, its request drained {drained:.1f} s:\n{out[-400:]}")
