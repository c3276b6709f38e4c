"""Runtimes side by side, for real: three CPU llama-servers under a private user manager, on a
fixture tree with two B70s. `chat` is on card 0 and `second` on card 1, each on its own port
under its own name; `both` needs both cards, so starting it stops them, and `broken` (a corrupt
model) needs both too, so its failed start must bring both back."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from b70tools.net import free_port
from tests.conftest import B70CTL, GGUF, LLAMA_SERVER, Appliance, appliance_on_cards, live_pid

SLOTS = ["0000:03:00.0", "0000:07:00.0"]


def config_text(proxy: int, chat: int, second: int, monitor: int, corrupt: Path) -> str:
    def runtime(
        name: str, cards: str, port: int, extra: str = "", args: str = "", model: Path = GGUF
    ) -> str:
        return f"""
[runtimes.{name}]
engine = "llamacpp"
command = ["{LLAMA_SERVER}"]
model = "{model}"
cards = {cards}
port = {port}
start_timeout_s = 120
args = [{args}"-c", "2048", "--parallel", "2", "--threads", "1"]
{extra}"""

    return (
        f"""default_runtime = "chat"

[proxy]
port = {proxy}
model = "smollm2"
hold_s = 120

[gpu]
cards = {json.dumps(SLOTS)}

[monitor]
port = {monitor}
probe_completion = false
interval_s = 1
health_timeout_s = 1
hang_after = 2
"""
        + runtime("chat", "[0]", chat)
        # A reranker beside the chat model, on a card of its own (SmolLM2 is none: its scores
        # are no ranking, but the API and its way through :8000 are the same).
        + runtime("second", "[1]", second, 'served_model_name = "second"', '"--reranking", ')
        + runtime("both", "[0, 1]", chat)
        + runtime("broken", "[0, 1]", chat, model=corrupt)
    )


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    root = tmp_path_factory.mktemp("side")
    corrupt = root / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(4096))
    second, monitor = free_port(), free_port()

    def text(proxy: int, chat: int) -> str:
        return config_text(proxy, chat, second, monitor, corrupt)

    with appliance_on_cards(root, SLOTS, text) as appliance:
        yield appliance
    shutil.rmtree(root, ignore_errors=True)  # after the manager's stop, which reads its files


def ask(app: Appliance, model: str, max_tokens: int = 8) -> Any:
    return app.client().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=max_tokens,
        temperature=0,
        timeout=120,
    )


def units(app: Appliance) -> dict[str, dict[str, Any]]:
    status = app.json("status")["result"]
    return {u["unit"]: u for u in status["units"]}


def test_two_runtimes_serve_at_once_each_under_its_own_name(app: Appliance) -> None:
    app.b70ctl("switch", "chat", check=True)
    app.b70ctl("switch", "second", check=True)
    status = app.json("status")["result"]
    assert status["active_runtimes"] == ["chat", "second"]
    seen = units(app)
    assert seen["b70-chat.service"]["enabled"] == seen["b70-second.service"]["enabled"] == "enabled"
    assert seen["b70-second.service"]["model"] == "second"
    assert seen["b70-second.service"]["cards"].startswith("card 1 (0000:07:00.0")
    for model in ("smollm2", "second"):
        reply = ask(app, model)
        assert reply.model == model and reply.choices[0].message.content
    table = app.b70ctl("status", check=True).stdout
    assert "PORT" in table and "MODEL" in table and "second" in table


def test_a_reranker_on_its_own_card_answers_rerank_through_8000_beside_the_chat_model(
    app: Appliance,
) -> None:
    app.b70ctl("switch", "chat", check=True)
    app.b70ctl("switch", "second", check=True)
    rerank = {"query": "a cat", "documents": ["a cat sat on the mat", "Paris is a city"]}
    with httpx.Client(base_url=f"http://127.0.0.1:{app.proxy_port}", timeout=120,
                      headers={"Authorization": f"Bearer {app.key}"}) as c:  # fmt: skip
        ranked = c.post("/v1/rerank", json={**rerank, "model": "second"})
        assert ranked.status_code == 200, ranked.text
        assert sorted(r["index"] for r in ranked.json()["results"]) == [0, 1]
        refused = c.post("/rerank", json={**rerank, "model": "smollm2"})
        assert refused.status_code == 501, refused.text
        assert (
            "llama.cpp serves rerank only when started with `--reranking`"
            in (refused.json()["error"]["message"])
        )
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert "rerank" in listed["second"]["apis"] and "rerank" not in listed["smollm2"]["apis"]
    assert ask(app, "second").choices[0].message.content  # it still generates


def test_a_switch_on_one_card_holds_nothing_on_the_other(app: Appliance) -> None:
    """A stream on `second` runs through a restart of `chat`, and a new request to `second`
    made while the switch holds `chat`'s requests is answered before the switch ends."""
    app.b70ctl("switch", "chat", check=True)
    app.b70ctl("switch", "second", check=True)
    stream = app.story("second", 200)
    chunks = iter(stream)
    next(chunks)
    switch = subprocess.Popen(
        [B70CTL, "--user", "--config", str(app.config), "switch", "chat", "--restart", "--json"],
        env=app.manager.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        hold_file = Path(app.manager.env["XDG_STATE_HOME"]) / "b70" / "hold.json"
        deadline = time.monotonic() + 60
        while not hold_file.exists():
            assert time.monotonic() < deadline and switch.poll() is None, "no hold was marked"
            time.sleep(0.02)
        mark = json.loads(hold_file.read_text())
        assert mark["target"] == "chat" and mark["ports"] == [app.backend_port]
        reply = ask(app, "second", max_tokens=4)
        held_still = hold_file.exists()
        rest = list(chunks)
        out, err = switch.communicate(timeout=300)
    finally:
        if switch.poll() is None:
            switch.kill()
            switch.wait()
    assert switch.returncode == 0, err
    assert reply.choices[0].message.content
    assert held_still, "the answer for `second` came while `chat` was still held"
    usage = [c.usage for c in rest if c.usage]
    assert usage and usage[-1].completion_tokens == 200, "the stream on card 1 ran whole"
    assert json.loads(out)["result"]["previous"] == "chat"


def test_a_failed_switch_over_two_cards_brings_both_runtimes_back(app: Appliance) -> None:
    app.b70ctl("switch", "chat", check=True)
    app.b70ctl("switch", "second", check=True)
    out = app.b70ctl("switch", "broken")
    assert out.returncode == 1
    assert "switch to broken failed" in out.stderr
    assert "rolled back: chat, second are serving again" in out.stderr
    assert app.json("status")["result"]["active_runtimes"] == ["chat", "second"]
    assert ask(app, "smollm2").choices[0].message.content
    assert ask(app, "second").choices[0].message.content


def test_the_monitor_watches_each_runtime_and_restarts_the_one_that_hangs(app: Appliance) -> None:
    """`second` is not the first runtime by name: a monitor that watched one runtime only would
    never see it hang."""
    app.b70ctl("switch", "chat", check=True)
    app.b70ctl("switch", "second", check=True)
    chat, before = live_pid(app, "b70-chat.service"), live_pid(app, "b70-second.service")
    os.kill(before, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while live_pid(app, "b70-second.service") == before:
            assert time.monotonic() < deadline, "the hung runtime was not restarted"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before, signal.SIGCONT)
    app.b70ctl("switch", "second", check=True)  # serving again (waits for the restart)
    assert live_pid(app, "b70-chat.service") == chat, "the runtime beside it was left alone"
    action = app.json("status")["result"]["monitor"]["last_action"]
    assert action["what"] == "restart" and action["runtime"] == "second", action
    assert ask(app, "second").choices[0].message.content


def test_a_runtime_on_both_cards_stops_both_and_serves_their_shared_name(app: Appliance) -> None:
    app.b70ctl("switch", "chat", check=True)
    app.b70ctl("switch", "second", check=True)
    result = app.json("switch", "both")["result"]
    assert result["previous"] == "chat, second"
    assert app.json("status")["result"]["active_runtimes"] == ["both"]
    seen = units(app)
    assert [seen[f"b70-{n}.service"]["enabled"] for n in ("chat", "second", "both")] == [
        "disabled", "disabled", "enabled"
    ]  # fmt: skip
    assert ask(app, "smollm2").model == "smollm2"
