"""Switching on demand on a real appliance: a private user manager, the real proxy and monitor,
two llama.cpp runtimes that take turns on one card under two names (smollm2, smollm2-b), and a
third whose start fails (a corrupt model, as broken-model). Clients are the OpenAI SDK's."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from b70tools.net import free_port
from tests.conftest import GGUF, LLAMA_SERVER, Appliance, own_appliance


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    root = tmp_path_factory.mktemp("demand")
    corrupt = root / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    port_b, port_c = free_port(), free_port()
    extra = f"""
[runtimes.llamacpp-b]
engine = "llamacpp"
command = ["{LLAMA_SERVER}"]
model = "{GGUF}"
served_model_name = "smollm2-b"
port = {port_b}
start_timeout_s = 120
args = ["-c", "2048", "--parallel", "2", "--threads", "1"]

[runtimes.broken]
engine = "llamacpp"
command = ["{LLAMA_SERVER}"]
model = "{corrupt}"
served_model_name = "broken-model"
port = {port_c}
start_timeout_s = 60

[switching]
on_demand = true
max_wait_s = 60
stay_factor = 0.5
backoff_s = 600
"""
    with own_appliance(root, extra) as appliance:
        yield appliance


def history(app: Appliance) -> list[dict[str, Any]]:
    path = Path(app.manager.env["XDG_STATE_HOME"]) / "b70" / "switches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ask(app: Appliance, model: str, timeout: float = 150) -> str:
    reply = app.client().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8,
        temperature=0,
        timeout=timeout,
    )
    return reply.choices[0].message.content or ""


def serving(app: Appliance, name: str) -> None:
    """`name` serves, by hand, and no pin holds."""
    app.b70ctl("unpin", check=True)
    app.b70ctl("switch", name, check=True)


def demand(app: Appliance) -> dict[str, Any]:
    return app.json("status")["result"]["demand"]  # type: ignore[no-any-return]


def wait_for(what: Any, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return got


def test_a_request_for_the_other_model_brings_its_runtime_up(app: Appliance) -> None:
    serving(app, "llamacpp")
    before = len(history(app))
    assert ask(app, "smollm2-b")
    made = [(r["to"], r["reason"], r["ok"]) for r in history(app)[before:]]
    assert made == [("llamacpp-b", "demand", True)]
    status = app.json("status")["result"]
    assert status["active_runtime"] == "llamacpp-b"
    assert status["demand"]["on_demand"] and status["demand"]["last_reason"] == "demand"
    assert "llamacpp -> llamacpp-b" in app.b70ctl("status").stdout
    assert ask(app, "smollm2-b")  # and it goes on serving it


def test_a_flood_for_the_other_model_makes_one_swap_and_every_request_is_answered(
    app: Appliance,
) -> None:
    serving(app, "llamacpp-b")
    before = len(history(app))
    answers: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            answers.append(ask(app, "smollm2"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == [] and len(answers) == 12
    made = [(r["to"], r["reason"]) for r in history(app)[before:]]
    assert made == [("llamacpp", "demand")], made


def test_a_pin_holds_demand_off_a_client_that_leaves_leaves_the_queue_and_unpin_lets_it_swap(
    app: Appliance,
) -> None:
    import openai

    serving(app, "llamacpp")
    switched = app.json("switch", "llamacpp", "--pin", "10m")
    assert any("pinned for 10m" in n for n in switched["result"]["notes"]), switched
    before = len(history(app))
    with pytest.raises(openai.APITimeoutError):
        ask(app, "smollm2-b", timeout=3)
    wait_for(lambda: demand(app)["queues"] == [], 10)  # it left, and its place with it
    answers: list[str] = []
    waiter = threading.Thread(target=lambda: answers.append(ask(app, "smollm2-b")))
    waiter.start()
    try:
        queue = wait_for(lambda: demand(app)["queues"])
        assert [(q["model"], q["runtime"], q["waiting"]) for q in queue] == [
            ("smollm2-b", "llamacpp-b", 1)
        ]
        # the runner writes its reason at its next look (twice a second)
        seen = wait_for(lambda: (d := demand(app))["decision"] is not None and d, 10)
        assert seen["pin"]["runtime"] == "llamacpp" and seen["decision"]["reason"] == "pinned"
        text = app.b70ctl("status").stdout
        assert "1 for smollm2-b (llamacpp-b)" in text and "pin       llamacpp until" in text
        time.sleep(2)
        assert len(history(app)) == before, "a pin holds against demand"
    finally:
        app.b70ctl("unpin", check=True)
        waiter.join(timeout=150)
    assert answers and answers[0]
    made = [(r["to"], r["reason"]) for r in history(app)[before:]]
    assert made == [("llamacpp-b", "demand")]


def test_a_runtime_that_fails_to_start_gets_its_queue_a_503_and_is_not_tried_again(
    app: Appliance,
) -> None:
    import openai

    serving(app, "llamacpp")
    before = len(history(app))
    with pytest.raises(openai.InternalServerError) as first:
        ask(app, "broken-model")
    assert first.value.status_code == 503
    assert "broken failed to start on demand" in str(first.value), first.value
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as second:
        ask(app, "broken-model")
    assert time.monotonic() - start < 5 and "not tried again" in str(second.value)
    made = [(r["to"], r["reason"], r["ok"]) for r in history(app)[before:]]
    assert made == [("broken", "demand", False)], "one try, then the backoff"
    status = app.json("status")["result"]
    assert status["active_runtime"] == "llamacpp"  # rolled back
    assert [r["runtime"] for r in status["demand"]["refused"]] == ["broken"]
    assert "refused   broken for" in app.b70ctl("status").stdout
    assert ask(app, "smollm2")  # the rest goes on
