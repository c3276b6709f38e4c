"""The door's checks against the serving runtime's context: max_tokens and prompts counted by
the runtime (tests/doorkit.py answers as vLLM and llama-server do)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from appliance.proxy import backend as proxy_backend
from appliance.proxy import chain
from appliance.proxy import checks as proxy_checks
from tests.doorkit import AUTH, Clock, Runtime, call, chat, door

# --- against the runtime's context --------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_max_tokens_beyond_the_context_of_the_serving_runtime_is_400(engine: str) -> None:
    runtime = Runtime(engine, context=2048)
    door_app, inner = door(runtime)
    answer = call(door_app, "POST", "/v1/chat/completions", chat(max_tokens=100000000), AUTH)
    assert answer.status == 400
    name = {"vllm": "vLLM", "llamacpp": "llama.cpp"}[engine]
    assert answer.error["message"] == (
        f"max_tokens is 100000000, more than the context of the runtime that serves ({name}): "
        "2048 tokens for the prompt and the answer together"
    )
    assert answer.error["code"] == "integer_above_max_value"
    assert call(door_app, "POST", "/v1/chat/completions", chat(max_tokens=2048), AUTH).status == 200
    assert len(inner.calls) == 1
    asked = [a for a in runtime.asked if "tokenize" not in a]
    assert asked.count("GET /v1/models") == 1, "asked once, and kept"


def test_a_runtime_that_cannot_say_lets_the_runtime_itself_judge() -> None:
    clock = Clock()
    runtime = Runtime("vllm", up=False)
    door_app, _ = door(runtime, clock)
    assert (
        call(door_app, "POST", "/v1/chat/completions", chat(max_tokens=10**8), AUTH).status == 200
    )
    runtime.up = True
    assert (
        call(door_app, "POST", "/v1/chat/completions", chat(max_tokens=10**8), AUTH).status == 200
    )
    assert runtime.asked == ["GET /v1/models"], "not asked again before each request"
    clock.now += proxy_backend.FACTS_TTL_S + 1
    assert (
        call(door_app, "POST", "/v1/chat/completions", chat(max_tokens=10**8), AUTH).status == 400
    )


def test_a_runtime_that_could_not_say_is_asked_again_beside_the_requests() -> None:
    """A runtime that does not answer the door's questions (down, loading, or another kind of
    server) costs the requests nothing: after FRESH_S it is asked again, and they go on."""
    clock, runtime = Clock(), Runtime("vllm", up=False)
    backend = proxy_backend.Backend("http://runtime", clock, httpx.MockTransport(runtime.handle))

    async def scenario() -> None:
        assert await backend.facts() is None
        runtime.up = True
        assert await backend.facts() is None and len(runtime.asked) == 1
        clock.now += proxy_backend.FRESH_S + 0.1
        assert await backend.facts() is None, "it went on without waiting for the answer"
        assert backend._asking is not None
        await backend._asking
        assert len(runtime.asked) == 2
        assert await backend.facts() == proxy_backend.Facts("vLLM", 2048, "smollm2")

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("status", "body", "again_after"),
    [
        (200, {"status": "ok"}, proxy_backend.FACTS_TTL_S),  # another kind of server
        (404, {"error": "not found"}, proxy_backend.FACTS_TTL_S),
        (503, {"error": "loading"}, proxy_backend.FRESH_S),  # a runtime loading its model
    ],
)
def test_a_server_that_answers_without_saying_is_not_asked_every_second(
    status: int, body: dict[str, Any], again_after: float
) -> None:
    """It will not say more a second later: asking it beside every request would cost each
    request a question on the worker's loop. A runtime still loading is asked again soon."""
    clock, asked = Clock(), []

    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(status, json=body)

    backend = proxy_backend.Backend("http://runtime", clock, httpx.MockTransport(handle))

    async def scenario() -> None:
        assert await backend.facts() is None and len(asked) == 1
        clock.now += proxy_backend.FRESH_S + 0.1
        assert await backend.facts() is None
        if backend._asking is not None:
            await backend._asking
        assert len(asked) == (2 if again_after == proxy_backend.FRESH_S else 1)
        clock.now += proxy_backend.FACTS_TTL_S
        assert await backend.facts(fresh=True) is None, "asked again before a refusal"
        assert len(asked) == (3 if again_after == proxy_backend.FRESH_S else 2)

    asyncio.run(scenario())


def test_a_kept_context_is_renewed_and_never_refuses_on_an_old_answer() -> None:
    clock = Clock()
    runtime = Runtime("llamacpp", context=1024)
    door_app, _ = door(runtime, clock)

    async def scenario() -> list[int]:
        statuses = []
        for max_tokens in (1000, 2000):  # the first asks; the second is refused on a fresh answer
            statuses.append(await acall(door_app, chat(max_tokens=max_tokens)))
        runtime.context = 4096  # a switch to a runtime with a longer context
        clock.now += 5
        statuses.append(await acall(door_app, chat(max_tokens=2000)))  # asked again before refusing
        runtime.context = 512
        clock.now += proxy_backend.FACTS_TTL_S + 1
        statuses.append(
            await acall(door_app, chat(max_tokens=1000))
        )  # passes on the kept answer ...
        while runtime.asked.count("GET /props") < 3:  # ... which is renewed behind it
            await asyncio.sleep(0)
        statuses.append(await acall(door_app, chat(max_tokens=1000)))
        return statuses

    assert asyncio.run(scenario()) == [200, 400, 200, 200, 400]
    assert runtime.asked.count("GET /props") == 3


async def acall(app: Any, body: bytes) -> int:
    status = 0
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        status = message.get("status", status)

    headers = [(b"authorization", AUTH["authorization"].encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    await app(scope, receive, send)
    return status


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_a_short_prompt_is_never_counted(engine: str) -> None:
    runtime = Runtime(engine, context=2048)
    door_app, _ = door(runtime, limit=chain.DEFAULT_MAX_BODY_BYTES)
    text = "x" * (2048 - proxy_backend.TEMPLATE_SLACK - 200)
    assert call(door_app, "POST", "/v1/chat/completions", chat(messages=[
        {"role": "user", "content": text}]), AUTH).status == 200  # fmt: skip
    assert not [a for a in runtime.asked if "tokenize" in a or "template" in a]


@pytest.mark.parametrize(
    ("engine", "asks"),
    [("vllm", ["POST /tokenize"]), ("llamacpp", ["POST /apply-template", "POST /tokenize"])],
)
def test_a_long_prompt_is_counted_by_the_runtime_and_refused_only_when_over(
    engine: str, asks: list[str]
) -> None:
    runtime = Runtime(engine, context=1024)
    door_app, inner = door(runtime, limit=1 << 20)
    fits = chat(messages=[{"role": "user", "content": "x" * 3000}])  # 750 tokens at 4 bytes
    assert len(fits) > 1024
    assert call(door_app, "POST", "/v1/chat/completions", fits, AUTH).status == 200
    assert [a for a in runtime.asked if a.startswith("POST")] == asks
    too_long = chat(messages=[{"role": "user", "content": "x" * 900}] * 5)
    answer = call(door_app, "POST", "/v1/chat/completions", too_long, AUTH)
    assert answer.status == 400
    assert answer.error["code"] == "context_length_exceeded"
    assert answer.error["param"] == "messages"
    assert "this prompt is 11" in answer.error["message"]
    assert len(inner.calls) == 1


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_completion_prompts_are_counted_one_by_one(engine: str) -> None:
    runtime = Runtime(engine, context=1024)
    door_app, _ = door(runtime, limit=1 << 20)

    def completion(prompt: Any) -> int:
        body = json.dumps({"model": "smollm2", "prompt": prompt}).encode()
        answer = call(door_app, "POST", "/v1/completions", body, AUTH)
        return answer.status

    def counted() -> int:
        return runtime.asked.count("POST /tokenize")

    assert completion(["y" * 4000, "y" * 400]) == 200
    assert counted() == 1, "a prompt that surely fits is not counted"
    assert completion(["y" * 10, "y" * 4400]) == 400
    assert completion(["y" * 4400] * 9) == 200, "nine long prompts are the runtime's to judge"
    before = counted()
    assert completion([7] * 1025) == 400, "token ids are counted here, exactly"
    assert completion([[7] * 1024, [7]]) == 200
    assert counted() == before, "no runtime is asked to count token ids"


def test_a_runtime_that_cannot_count_lets_the_prompt_through() -> None:
    runtime = Runtime("vllm", context=1024)
    runtime.can_count = False
    door_app, _ = door(runtime, limit=1 << 20)
    long = chat(messages=[{"role": "user", "content": "x" * 8000}])
    assert call(door_app, "POST", "/v1/chat/completions", long, AUTH).status == 200
    assert "POST /tokenize" in runtime.asked


def test_a_prompt_far_over_is_refused_without_counting() -> None:
    runtime = Runtime("vllm", context=100)
    door_app, _ = door(runtime, limit=1 << 20)
    text = "x" * (101 * proxy_checks.MAX_TOKEN_BYTES)
    answer = call(door_app, "POST", "/v1/chat/completions", chat(messages=[
        {"role": "assistant", "content": "y"}, {"role": "user", "content": text}]), AUTH)  # fmt: skip
    assert answer.status == 400
    assert answer.error["message"].startswith("this prompt is at least 101 tokens, more than")
    body = json.dumps({"model": "smollm2", "prompt": ["a", text]}).encode()
    assert call(door_app, "POST", "/v1/completions", body, AUTH).status == 400
    assert not [a for a in runtime.asked if a.startswith("POST")]
    # Only the users' messages count towards the bound: a template may drop earlier answers.
    answer = call(door_app, "POST", "/v1/chat/completions", chat(messages=[
        {"role": "assistant", "content": text}, {"role": "user", "content": "hi"}]), AUTH)  # fmt: skip
    assert answer.status == 400, "counted by the runtime instead"
    assert runtime.asked[-1] == "POST /tokenize"


def test_a_prompt_with_images_is_left_to_the_runtime() -> None:
    runtime = Runtime("vllm", context=100)
    door_app, _ = door(runtime, limit=1 << 20)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 2000}}
    content = [{"type": "text", "text": "what is it?"}, image]
    body = chat(messages=[{"role": "user", "content": content}])
    assert call(door_app, "POST", "/v1/chat/completions", body, AUTH).status == 200
    assert not [a for a in runtime.asked if a.startswith("POST")]


def test_a_foreign_server_on_the_backend_port_is_no_runtime() -> None:
    def foreign(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": ["not", "a", "runtime"]})

    backend = proxy_backend.Backend("http://x", Clock(), httpx.MockTransport(foreign))
    assert asyncio.run(backend.facts()) is None


def test_token_counts_are_read_from_the_raw_answers() -> None:
    assert proxy_backend.count_field(b'{"count":3,"max_model_len":2048,"tokens":[1,2,3]}') == 3
    assert proxy_backend.count_array(b'{"tokens": [1, 2, 3]}') == 3
    assert proxy_backend.count_array(b'{"tokens":[]}') == 0
    with pytest.raises(ValueError):
        proxy_backend.count_field(b'{"tokens": []}')
