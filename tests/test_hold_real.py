"""The request hold and the key check inside the real LiteLLM proxy, under a real systemd user
manager, with llama-server as the runtime and the OpenAI SDK as the client."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appliance import hold
from appliance.layout import MONITOR_UNIT
from tests.conftest import (
    Appliance,
    demo_config_text,
    free_port,
    installed,
    require_real_parts,
    running_manager,
)

HOLD_S = 12
KINDS = ("chat", "chat-stream", "completion", "completion-stream")


@pytest.fixture(scope="module")
def held_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    require_real_parts()
    root = tmp_path_factory.mktemp("hold")
    proxy_port, backend_port = free_port(), free_port()
    text = demo_config_text(proxy_port, backend_port).replace("hold_s = 120", f"hold_s = {HOLD_S}")
    assert f"hold_s = {HOLD_S}" in text
    with running_manager(root / "manager") as manager:
        cfg = root / "appliance.toml"
        cfg.write_text(text)
        # The monitor would heal what we break here.
        with installed(manager, cfg, proxy_port, backend_port, stop=(MONITOR_UNIT,)) as app:
            yield app
    # Only now that the manager is stopped: one whose files are gone ignores SIGTERM and lives on.
    shutil.rmtree(root, ignore_errors=True)


def ask(app: Appliance, kind: str, key: str | None = None) -> tuple[str, float]:
    """One request of `kind`; returns its text (or raises the SDK's error) and its seconds."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{app.proxy_port}/v1",
        api_key=app.key if key is None else key,
        max_retries=0,
        timeout=120,
    )
    start = time.monotonic()
    common: dict[str, Any] = {"model": "smollm2", "max_tokens": 8, "temperature": 0}
    if kind.startswith("chat"):
        messages = [{"role": "user", "content": "Say hello."}]
        if kind == "chat":
            text = client.chat.completions.create(messages=messages, **common)
            out = text.choices[0].message.content or ""
        else:
            chunks = client.chat.completions.create(messages=messages, stream=True, **common)
            out = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    elif kind == "completion":
        out = client.completions.create(prompt="Hello", **common).choices[0].text
    else:
        chunks = client.completions.create(prompt="Hello", stream=True, **common)
        out = "".join(c.choices[0].text or "" for c in chunks if c.choices)
    return out, time.monotonic() - start


def ask_all(app: Appliance) -> dict[str, Any]:
    """The four kinds at once, each in its own thread; value: (text, seconds) or the exception."""
    results: dict[str, Any] = {}

    def one(kind: str) -> None:
        try:
            results[kind] = ask(app, kind)
        except Exception as e:  # the test inspects it
            results[kind] = e

    threads = [threading.Thread(target=one, args=(k,)) for k in KINDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize(
    ("headers", "says"),
    [({}, "no API key"), ({"Authorization": "Bearer sk-wrong"}, "not the appliance's key")],
)
def test_a_missing_or_wrong_key_gets_401_with_a_json_error(
    held_app: Appliance, headers: dict[str, str], says: str
) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"http://127.0.0.1:{held_app.proxy_port}/v1/chat/completions"
    response = httpx.post(url, json=body, headers=headers, timeout=30)
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/json"
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert says in error["message"]
    assert error["type"] == "authentication_error"


def test_the_sdk_sees_a_wrong_key_as_an_authentication_error(held_app: Appliance) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        ask(held_app, "chat-stream", key="sk-wrong")
    assert e.value.status_code == 401


def test_requests_wait_for_a_stopped_runtime_and_go_through_when_it_is_back(
    held_app: Appliance,
) -> None:
    held_app.manager.systemctl("stop", "b70-llamacpp.service")
    state_dir = Path(held_app.manager.env["XDG_STATE_HOME"]) / "b70"
    before = hold.read_counts(state_dir).total
    starter = threading.Timer(2.5, held_app.manager.systemctl, ("start", "b70-llamacpp.service"))
    starter.start()
    results = ask_all(held_app)
    starter.join()
    for kind in KINDS:
        assert not isinstance(results[kind], Exception), (kind, results[kind])
        text, seconds = results[kind]
        assert text.strip(), kind
        assert seconds > 2.5, (kind, seconds)  # held until the runtime was back, not refused
    assert hold.read_counts(state_dir).total - before == len(KINDS)
    shown = held_app.json("status")["result"]["hold"]
    assert shown["switching_to"] is None and shown["held_now"] == 0
    assert shown["held_total"] - before == len(KINDS)


def test_the_hold_runs_out_with_503_and_retry_after(held_app: Appliance) -> None:
    held_app.manager.systemctl("stop", "b70-llamacpp.service")
    try:
        results = ask_all(held_app)
    finally:
        held_app.manager.systemctl("start", "b70-llamacpp.service")
    for kind in KINDS:
        e = results[kind]
        assert isinstance(e, openai.APIStatusError), (kind, e)
        assert e.status_code == 503, kind
        assert e.response.headers["retry-after"] == "3", kind
        message = e.response.json()["error"]["message"]
        assert "the backend is not healthy" in message and f"waited {HOLD_S} s" in message
    assert ask(held_app, "chat")[0].strip()
