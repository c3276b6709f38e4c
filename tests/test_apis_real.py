"""Every client of tests/clientkit.py at once, each in a loop through :8000, while the runtime is
switched away and back (llama.cpp to a second llama.cpp runtime, both with embeddings): no call
fails, and every client has a call under way during a switch. The same clients against each demo
runtime are in tests/test_door_real.py; OpenAI Responses and Anthropic Messages streams across a
switch to vLLM and back are in tests/test_load_real.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests import clientkit
from tests.conftest import Appliance


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
