"""The door (appliance.proxy.door), called as a plain ASGI app in this process: routes, the key,
the body limit and the request checks. The runtime behind it is answered by httpx's MockTransport
in the shapes the real runtimes answer (tests/test_door_real.py asks the real ones)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from appliance.proxy import backend as proxy_backend
from appliance.proxy import checks as proxy_checks
from appliance.proxy import door as proxy_gate
from appliance.proxy import hold, mount, relay, waiting

KEY = "sk-b70-right"
AUTH = {"authorization": f"Bearer {KEY}"}
MODELS = {"smollm2", "default"}
LIMIT = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Runtime:
    """A serving runtime on the far side of httpx.MockTransport, vLLM or llama-server."""

    def __init__(self, engine: str, context: int = 2048, up: bool = True) -> None:
        self.engine, self.context, self.up = engine, context, up
        self.asked: list[str] = []
        self.bytes_per_token = 4  # how this runtime's tokenizer counts text
        self.can_count = True

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.asked.append(f"{request.method} {request.url.path}")
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content) if request.content else {}
        path = request.url.path
        if path == "/v1/models" and self.engine == "vllm":
            served = {"id": "smollm2", "object": "model", "owned_by": "vllm"}
            return httpx.Response(200, json={"data": [{**served, "max_model_len": self.context}]})
        if path == "/v1/models":
            served = {"id": "smollm2", "object": "model", "owned_by": "llamacpp"}
            return httpx.Response(200, json={"data": [{**served, "meta": {"n_ctx_train": 8192}}]})
        if path == "/props" and self.engine == "llamacpp":
            settings = {"n_ctx": self.context, "params": {}}
            return httpx.Response(200, json={"default_generation_settings": settings})
        if not self.can_count and path != "/v1/models":
            return httpx.Response(500, json={"error": "boom"})
        if path == "/apply-template" and self.engine == "llamacpp":
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}" for m in body["messages"])
            return httpx.Response(200, json={"prompt": text})
        if path == "/tokenize" and self.engine == "llamacpp":
            return httpx.Response(200, json={"tokens": [1] * self.count(body["content"])})
        if path == "/tokenize":
            text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
            return httpx.Response(200, json={"count": self.count(text), "tokens": []})
        return httpx.Response(404, json={"error": "not found"})

    def count(self, text: str) -> int:
        return len(text.encode()) // self.bytes_per_token


class Inner:
    """LiteLLM's place: records what reaches it, and reads the body as Starlette does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.after_body: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        if scope["method"] == "POST":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            self.after_body.append(await receive())  # the client's own next message
        self.calls.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})


def door(
    runtime: Runtime | None = None, clock: Clock | None = None, limit: int = LIMIT
) -> tuple[proxy_gate.Door, Inner]:
    inner = Inner()
    backend = None
    if runtime is not None:
        transport = httpx.MockTransport(runtime.handle)
        backend = proxy_backend.Backend("http://runtime", clock or Clock(), transport)
    gate = proxy_gate.Door(inner, backend, lambda: MODELS, lambda: KEY, max_body_bytes=limit)
    return gate, inner


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.received = 0  # messages the app took from the client

    @property
    def error(self) -> dict[str, Any]:
        error: dict[str, Any] = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error


def call(
    app: Any,
    method: str,
    path: str,
    body: bytes | list[bytes] = b"",
    headers: dict[str, str] | None = None,
    leave: bool = False,
) -> Answer:
    """One request through an ASGI app; `body` as a list arrives in those chunks (chunked);
    `leave`: the client leaves before the last chunk says it is the last."""
    chunks = body if isinstance(body, list) else [body]
    head = {k.lower(): v for k, v in (headers or {}).items()}
    if not isinstance(body, list):
        head.setdefault("content-length", str(len(body)))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in head.items()],
    }
    answer = Answer()

    async def receive() -> dict[str, Any]:
        answer.received += 1
        if answer.received <= len(chunks):
            more = leave or answer.received < len(chunks)
            return {"type": "http.request", "body": chunks[answer.received - 1], "more_body": more}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        else:
            answer.body += message.get("body", b"")

    asyncio.run(app(scope, receive, send))
    return answer


def chat(**fields: Any) -> bytes:
    request = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps({k: v for k, v in request.items() if v is not ...}).encode()


# --- routes -------------------------------------------------------------------------------------

ALLOWED = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/completions"),
    ("GET", "/v1/models"),
    ("GET", "/models"),
    ("GET", "/v1/models/smollm2"),
    ("GET", "/models/smollm2"),
    ("GET", "/health/liveliness"),
    ("GET", "/health/liveness"),
    ("GET", "/health/readiness"),
]
CLOSED = [
    "/", "/ui", "/ui/", "/ui/index.html", "/openapi.json", "/docs", "/redoc", "/swagger/x",
    "/health", "/health/readiness/details", "/key/generate", "/key/list", "/model/new",
    "/model/info", "/v1/model/info", "/config/update", "/get/config/callbacks", "/settings",
    "/debug/asyncio-tasks", "/spend/logs", "/global/spend", "/user/new", "/team/new",
    "/v1/embeddings", "/embeddings", "/v1/responses", "/v1/realtime", "/v1/messages",
    "/openai/deployments/smollm2/chat/completions", "/engines/smollm2/completions",
    "/mcp/", "/v1/models/smollm2/extra", "/v1/models/", "/v1/chat/completions/", "//v1/models",
    "/v1/models/gpt-4", "/models/smollm2:generateContent",
    "/V1/models", "/metrics", "/routes", "/lazy/warm/guardrails", "/sso/key/generate",
]  # fmt: skip


@pytest.mark.parametrize("path", CLOSED)
@pytest.mark.parametrize("headers", [{}, AUTH])
def test_every_other_path_is_404_with_or_without_the_key(
    path: str, headers: dict[str, str]
) -> None:
    gate, inner = door()
    for method in ("GET", "POST", "DELETE"):
        answer = call(gate, method, path, chat(), headers)
        assert answer.status == 404, (method, path)
        assert answer.headers["content-type"] == "application/json"
        assert answer.error["code"] == "not_found"
        assert answer.received == 0, "a closed path reads nothing"
    assert inner.calls == []


@pytest.mark.parametrize(("method", "path"), ALLOWED)
def test_the_allowed_routes_reach_litellm(method: str, path: str) -> None:
    gate, inner = door()
    body = {"POST": chat(prompt="hi"), "GET": b""}[method]
    answer = call(gate, method, path, body, AUTH)
    assert answer.status == 200, answer.body
    assert inner.calls[0][0] == path


def test_an_allowed_path_with_another_method_is_405() -> None:
    gate, inner = door()
    answer = call(gate, "GET", "/v1/chat/completions", headers=AUTH)
    assert answer.status == 405
    assert answer.headers["allow"] == "OPTIONS, POST"
    assert call(gate, "POST", "/v1/models/smollm2", chat(), AUTH).status == 405
    assert inner.calls == []


def test_any_model_path_passes_while_the_served_names_are_not_known() -> None:
    inner = Inner()
    gate = proxy_gate.Door(inner, None, lambda: None, lambda: KEY)
    assert call(gate, "GET", "/v1/models/anything", headers=AUTH).status == 200
    assert call(gate, "GET", "/v1/models/a/b", headers=AUTH).status == 404


def test_the_route_table_is_the_appliances() -> None:
    """Beside these, GET /v1/models/{name} for the names served (tests/test_door_real.py walks
    every route LiteLLM registers against the running proxy)."""
    assert set(proxy_gate.ROUTES) == {
        "/chat/completions", "/v1/chat/completions", "/completions", "/v1/completions",
        "/models", "/v1/models", "/health/liveliness", "/health/liveness", "/health/readiness",
    }  # fmt: skip


def test_probes_need_no_key_and_everything_else_does() -> None:
    gate, inner = door()
    assert call(gate, "GET", "/health/liveliness").status == 200
    for method, path in ALLOWED:
        if path.startswith("/health"):
            continue
        for headers, says in (({}, "no API key"), ({"authorization": "Bearer no"}, "not the")):
            answer = call(gate, method, path, chat(), headers)
            assert answer.status == 401, path
            assert answer.headers["www-authenticate"] == "Bearer"
            assert says in answer.error["message"]
            assert answer.error["type"] == "authentication_error"
            assert answer.received == 0, "the body of a request without the key is not read"
    assert [p for p, _ in inner.calls] == ["/health/liveliness"]


def test_a_root_path_is_routed_as_starlette_routes_it() -> None:
    scope = {"path": "/api/v1/models", "root_path": "/api"}
    assert proxy_gate.route_path(scope) == "/v1/models"
    assert proxy_gate.route_path({"path": "/apiv1/models", "root_path": "/api"}) == "/apiv1/models"


# --- the body -----------------------------------------------------------------------------------


def test_a_declared_length_over_the_limit_is_413_before_the_body_is_read() -> None:
    gate, inner = door()
    answer = call(gate, "POST", "/v1/chat/completions", b"", {**AUTH, "content-length": "1001"})
    assert answer.status == 413
    assert answer.error["code"] == "request_too_large"
    assert answer.error["message"].startswith(
        "the request body is 1001 bytes, more than the 1000 bytes"
    )
    assert answer.received == 0
    assert inner.calls == []


def test_a_chunked_body_is_counted_as_it_comes_and_refused_past_the_limit() -> None:
    gate, inner = door()
    chunks = [b"x" * 400] * 10  # 4000 bytes, no Content-Length
    answer = call(gate, "POST", "/v1/chat/completions", chunks, AUTH)
    assert answer.status == 413
    assert answer.received == 3, "refused at the chunk that passes 1000 bytes, not at the end"
    assert inner.calls == []


def test_a_body_at_the_limit_passes_whole_and_the_client_is_still_heard_after_it() -> None:
    gate, inner = door()
    body = chat(pad="x" * 10)
    body = body[:-1] + b" " * (LIMIT - len(body)) + b"}"
    assert len(body) == LIMIT
    chunks = [body[:300], body[300:]]
    assert call(gate, "POST", "/v1/chat/completions", chunks, AUTH).status == 200
    assert inner.calls == [("/v1/chat/completions", body)]
    assert inner.after_body == [{"type": "http.disconnect"}]


def test_a_client_that_leaves_while_sending_gets_nothing() -> None:
    gate, inner = door()
    answer = call(gate, "POST", "/v1/chat/completions", [b'{"model": ', b"x"], AUTH, leave=True)
    assert (answer.status, answer.body, answer.received) == (0, b"", 3)
    assert inner.calls == []


@pytest.mark.parametrize(
    "media_type", ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_body_sent_as_a_form_is_415_before_it_is_read(media_type: str) -> None:
    gate, inner = door()
    answer = call(gate, "POST", "/v1/chat/completions", chat(), AUTH | {"content-type": media_type})
    assert answer.status == 415
    assert "Content-Type: application/json" in answer.error["message"]
    assert answer.received == 0 and inner.calls == []
    headers = AUTH | {"content-type": "application/json; charset=utf-8"}
    assert call(gate, "POST", "/v1/chat/completions", chat(), headers).status == 200


@pytest.mark.parametrize(
    ("body", "status", "code", "says"),
    [
        (b"", 400, "invalid_json", "not valid JSON"),
        (b'{"model": "smollm2",', 400, "invalid_json", "not valid JSON"),
        (b'{"model": NaN}', 400, "invalid_json", "not valid JSON"),
        (b"\xff\xfe{}", 400, "invalid_json", "not valid JSON"),
        (b'[{"model": "smollm2"}]', 400, "invalid_type", "must be a JSON object, not an array"),
        (b'"hello"', 400, "invalid_type", "not a string"),
        (b"null", 400, "invalid_type", "not null"),
        (chat(model="gpt-4"), 404, "model_not_found", "The model `gpt-4` does not exist"),
        (chat(model=...), 400, "missing_required_parameter", "model is missing: it must be the name"),
        (chat(model=7), 400, "invalid_type", "model must be the name of a model this appliance serves, not an integer"),
        (chat(messages="hello"), 400, "invalid_type", "non-empty array of message objects, not a string"),
        (chat(messages=[]), 400, "invalid_type", "not an empty array"),
        (chat(messages=["hi"]), 400, "invalid_type", "items that are not objects"),
        (chat(messages=...), 400, "missing_required_parameter", "messages is missing: it must be a non-empty array"),
        (chat(max_tokens=-1), 400, "integer_below_min_value", "max_tokens must be at least 1, not -1"),
        (chat(max_tokens=0), 400, "integer_below_min_value", "at least 1, not 0"),
        (chat(max_tokens="5"), 400, "invalid_type", "max_tokens must be an integer, not a string"),
        (chat(max_tokens=5.0), 400, "invalid_type", "not a number"),
        (chat(max_tokens=True), 400, "invalid_type", "not a boolean"),
        (chat(max_completion_tokens=-5), 400, "integer_below_min_value", "max_completion_tokens"),
    ],
)  # fmt: skip
def test_bad_requests_get_a_clear_error_and_never_reach_litellm(
    body: bytes, status: int, code: str, says: str
) -> None:
    gate, inner = door()
    answer = call(gate, "POST", "/v1/chat/completions", body, AUTH)
    assert answer.status == status, answer.body
    assert answer.error["code"] == code
    assert says in answer.error["message"]
    assert answer.error["type"] == "invalid_request_error"
    assert inner.calls == []


@pytest.mark.parametrize("prompt", ["", "hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompts_of_every_kind_pass(prompt: Any) -> None:
    gate, _ = door()
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": 4}).encode()
    assert call(gate, "POST", "/v1/completions", body, AUTH).status == 200


@pytest.mark.parametrize("prompt", [None, [], 5, [1, "a"], [[]], [[1], "a"], {"text": "x"}])
def test_completion_prompts_of_no_kind_are_400(prompt: Any) -> None:
    gate, _ = door()
    fields = {"model": "smollm2", "max_tokens": 4} | ({"prompt": prompt} if prompt else {})
    answer = call(gate, "POST", "/v1/completions", json.dumps(fields).encode(), AUTH)
    assert answer.status == 400
    assert answer.error["param"] == "prompt"


# --- against the runtime's context --------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_max_tokens_beyond_the_context_of_the_serving_runtime_is_400(engine: str) -> None:
    runtime = Runtime(engine, context=2048)
    gate, inner = door(runtime)
    answer = call(gate, "POST", "/v1/chat/completions", chat(max_tokens=100000000), AUTH)
    assert answer.status == 400
    name = {"vllm": "vLLM", "llamacpp": "llama.cpp"}[engine]
    assert answer.error["message"] == (
        f"max_tokens is 100000000, more than the context of the runtime that serves ({name}): "
        "2048 tokens for the prompt and the answer together"
    )
    assert answer.error["code"] == "integer_above_max_value"
    assert call(gate, "POST", "/v1/chat/completions", chat(max_tokens=2048), AUTH).status == 200
    assert len(inner.calls) == 1
    asked = [a for a in runtime.asked if "tokenize" not in a]
    assert asked.count("GET /v1/models") == 1, "asked once, and kept"


def test_a_runtime_that_cannot_say_lets_the_runtime_itself_judge() -> None:
    clock = Clock()
    runtime = Runtime("vllm", up=False)
    gate, _ = door(runtime, clock)
    assert call(gate, "POST", "/v1/chat/completions", chat(max_tokens=10**8), AUTH).status == 200
    runtime.up = True
    assert call(gate, "POST", "/v1/chat/completions", chat(max_tokens=10**8), AUTH).status == 200
    assert runtime.asked == ["GET /v1/models"], "not asked again before each request"
    clock.now += proxy_backend.FACTS_TTL_S + 1
    assert call(gate, "POST", "/v1/chat/completions", chat(max_tokens=10**8), AUTH).status == 400


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


def test_a_kept_context_is_renewed_and_never_refuses_on_an_old_answer() -> None:
    clock = Clock()
    runtime = Runtime("llamacpp", context=1024)
    gate, _ = door(runtime, clock)

    async def scenario() -> list[int]:
        statuses = []
        for max_tokens in (1000, 2000):  # the first asks; the second is refused on a fresh answer
            statuses.append(await acall(gate, chat(max_tokens=max_tokens)))
        runtime.context = 4096  # a switch to a runtime with a longer context
        clock.now += 5
        statuses.append(await acall(gate, chat(max_tokens=2000)))  # asked again before refusing
        runtime.context = 512
        clock.now += proxy_backend.FACTS_TTL_S + 1
        statuses.append(await acall(gate, chat(max_tokens=1000)))  # passes on the kept answer ...
        while runtime.asked.count("GET /props") < 3:  # ... which is renewed behind it
            await asyncio.sleep(0)
        statuses.append(await acall(gate, chat(max_tokens=1000)))
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
    gate, _ = door(runtime, limit=proxy_gate.DEFAULT_MAX_BODY_BYTES)
    text = "x" * (2048 - proxy_backend.TEMPLATE_SLACK - 200)
    assert call(gate, "POST", "/v1/chat/completions", chat(messages=[
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
    gate, inner = door(runtime, limit=1 << 20)
    fits = chat(messages=[{"role": "user", "content": "x" * 3000}])  # 750 tokens at 4 bytes
    assert len(fits) > 1024
    assert call(gate, "POST", "/v1/chat/completions", fits, AUTH).status == 200
    assert [a for a in runtime.asked if a.startswith("POST")] == asks
    too_long = chat(messages=[{"role": "user", "content": "x" * 900}] * 5)
    answer = call(gate, "POST", "/v1/chat/completions", too_long, AUTH)
    assert answer.status == 400
    assert answer.error["code"] == "context_length_exceeded"
    assert answer.error["param"] == "messages"
    assert "this prompt is 11" in answer.error["message"]
    assert len(inner.calls) == 1


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_completion_prompts_are_counted_one_by_one(engine: str) -> None:
    runtime = Runtime(engine, context=1024)
    gate, _ = door(runtime, limit=1 << 20)

    def completion(prompt: Any) -> int:
        body = json.dumps({"model": "smollm2", "prompt": prompt}).encode()
        answer = call(gate, "POST", "/v1/completions", body, AUTH)
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
    gate, _ = door(runtime, limit=1 << 20)
    long = chat(messages=[{"role": "user", "content": "x" * 8000}])
    assert call(gate, "POST", "/v1/chat/completions", long, AUTH).status == 200
    assert "POST /tokenize" in runtime.asked


def test_a_prompt_far_over_is_refused_without_counting() -> None:
    runtime = Runtime("vllm", context=100)
    gate, _ = door(runtime, limit=1 << 20)
    text = "x" * (101 * proxy_checks.MAX_TOKEN_BYTES)
    answer = call(gate, "POST", "/v1/chat/completions", chat(messages=[
        {"role": "assistant", "content": "y"}, {"role": "user", "content": text}]), AUTH)  # fmt: skip
    assert answer.status == 400
    assert answer.error["message"].startswith("this prompt is at least 101 tokens, more than")
    body = json.dumps({"model": "smollm2", "prompt": ["a", text]}).encode()
    assert call(gate, "POST", "/v1/completions", body, AUTH).status == 400
    assert not [a for a in runtime.asked if a.startswith("POST")]
    # Only the users' messages count towards the bound: a template may drop earlier answers.
    answer = call(gate, "POST", "/v1/chat/completions", chat(messages=[
        {"role": "assistant", "content": text}, {"role": "user", "content": "hi"}]), AUTH)  # fmt: skip
    assert answer.status == 400, "counted by the runtime instead"
    assert runtime.asked[-1] == "POST /tokenize"


def test_a_prompt_with_images_is_left_to_the_runtime() -> None:
    runtime = Runtime("vllm", context=100)
    gate, _ = door(runtime, limit=1 << 20)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 2000}}
    content = [{"type": "text", "text": "what is it?"}, image]
    body = chat(messages=[{"role": "user", "content": content}])
    assert call(gate, "POST", "/v1/chat/completions", body, AUTH).status == 200
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


# --- installing it ------------------------------------------------------------------------------


def starlette_app() -> Starlette:
    async def hello(request: Any) -> JSONResponse:
        return JSONResponse({"path": request.url.path})

    return Starlette(routes=[Route(p, hello) for p in ("/v1/models", "/key/generate")])


def test_install_wraps_a_built_stack_in_place_and_an_unbuilt_one_when_it_is_built() -> None:
    made: list[Any] = []

    def make(inner: Any) -> proxy_gate.Door:
        made.append(inner)
        return proxy_gate.Door(inner, None, lambda: MODELS, lambda: KEY)

    for built in (True, False):
        app = starlette_app()
        if built:
            call(app, "GET", "/key/generate")  # the first call builds the stack
            assert app.middleware_stack is not None
        assert mount.install(app, make)
        assert not mount.install(app, make), "once"
        assert call(app, "GET", "/key/generate", headers=AUTH).status == 404
        answer = call(app, "GET", "/v1/models", headers=AUTH)
        assert (answer.status, json.loads(answer.body)) == (200, {"path": "/v1/models"})
    assert len(made) == 2


def test_install_in_proxy_does_nothing_outside_the_proxy() -> None:
    assert mount.install_in_proxy(None, env={"B70_BACKEND_URL": "http://x"}) is None


@pytest.mark.parametrize(
    ("value", "limit"),
    [("", proxy_gate.DEFAULT_MAX_BODY_BYTES), ("1048576", 1048576), ("0", 8 << 20), ("x", 8 << 20)],
)
def test_the_body_limit_comes_from_the_environment(value: str, limit: int) -> None:
    assert mount.max_body_bytes({"B70_MAX_BODY_BYTES": value}) == limit


# --- a request whose runtime died before it answered is sent again ----------------------------


def litellm_500(message: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": None, "param": None, "code": "500"}}
    ).encode()


REFUSED = litellm_500(
    "litellm.InternalServerError: Hosted_vllmException - Cannot connect to host "
    "127.0.0.1:8001 ssl:default [Connection refused]"
)
OTHER_500 = litellm_500("litellm.InternalServerError: the runtime said: out of memory")


class Failing:
    """LiteLLM's place, with a runtime that is down for the first `fails` requests: each gets
    LiteLLM's 500 about the failed connection; then 200, as a stream or not."""

    def __init__(self, fails: int, error: bytes = REFUSED, stream: bool = False) -> None:
        self.fails, self.error, self.stream = fails, error, stream
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        if len(self.bodies) <= self.fails:
            start = {"type": "http.response.start", "status": 500}
            await send({**start, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": self.error})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if self.stream:
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})


class Ready:
    """The hold, as the door sees it: how long each wait took, or None when it ran out."""

    def __init__(self, clock: Clock, waits: list[float | None]) -> None:
        self.clock, self.waits = clock, list(waits)
        self.asked: list[float] = []
        self.tokens: list[str | None] = []

    async def __call__(self, limit_s: float, token: str | None) -> float | None:
        self.asked.append(limit_s)
        self.tokens.append(token)
        waited = self.waits.pop(0) if self.waits else 0.0
        if waited is None:
            self.clock.now += limit_s
            return None
        self.clock.now += waited
        return waited


def replaying(inner: Any, ready: Ready, clock: Clock, hold_s: float = 60) -> proxy_gate.Door:
    return proxy_gate.Door(
        inner, None, lambda: MODELS, lambda: KEY, max_body_bytes=LIMIT, wait_ready=ready,
        hold_s=hold_s, clock=clock,
    )  # fmt: skip


def test_a_request_whose_runtime_died_waits_and_is_sent_again_whole() -> None:
    clock = Clock()
    inner, ready = Failing(fails=1), Ready(clock, [6.5])
    body = chat(max_tokens=5)
    answer = call(replaying(inner, ready, clock), "POST", "/v1/chat/completions", body, AUTH)
    assert (answer.status, answer.body) == (200, b'{"ok": true}')
    assert inner.bodies == [body, body]
    assert ready.asked == [60] and ready.tokens == [None]


def test_a_switch_own_request_sent_again_waits_with_its_hold_token() -> None:
    """The switch's verification must not wait behind the switch's own hold."""
    clock = Clock()
    inner, ready = Failing(fails=1), Ready(clock, [0.5])
    headers = {**AUTH, hold.BYPASS_HEADER: "t0ken"}
    answer = call(replaying(inner, ready, clock), "POST", "/v1/chat/completions", chat(), headers)
    assert answer.status == 200 and ready.tokens == ["t0ken"]


def test_it_is_sent_again_at_most_twice_then_litellms_answer_goes_out() -> None:
    """A request that kills the runtime each time must not keep killing it."""
    clock = Clock()
    inner, ready = Failing(fails=5), Ready(clock, [1.0, 1.0])
    answer = call(replaying(inner, ready, clock), "POST", "/v1/chat/completions", chat(), AUTH)
    assert (answer.status, answer.body) == (500, REFUSED)
    assert len(inner.bodies) == 1 + relay.REPLAYS == 3


def test_the_wait_is_within_the_hold_time_from_arrival_and_ends_in_a_503() -> None:
    clock = Clock()

    class Slow(Failing):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            clock.now += 20  # LiteLLM's own attempts took this long
            await super().__call__(scope, receive, send)

    inner, ready = Slow(fails=5), Ready(clock, [None])
    answer = call(replaying(inner, ready, clock, hold_s=60), "POST", "/v1/completions",
                  json.dumps({"model": "smollm2", "prompt": "hi"}).encode(), AUTH)  # fmt: skip
    assert ready.asked == [40]
    assert answer.status == 503 and answer.headers["retry-after"] == "15"
    assert answer.error["code"] == "b70_hold_timeout"
    assert "stopped answering" in answer.error["message"]
    assert len(inner.bodies) == 1


def test_a_hold_time_used_up_sends_litellms_answer_without_waiting() -> None:
    clock = Clock()

    class Slow(Failing):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            clock.now += 61
            await super().__call__(scope, receive, send)

    inner, ready = Slow(fails=5), Ready(clock, [])
    answer = call(replaying(inner, ready, clock), "POST", "/v1/chat/completions", chat(), AUTH)
    assert (answer.status, answer.body, ready.asked) == (500, REFUSED, [])


def test_other_failures_and_begun_answers_pass_as_they_are() -> None:
    clock = Clock()
    inner, ready = Failing(fails=1, error=OTHER_500), Ready(clock, [])
    answer = call(replaying(inner, ready, clock), "POST", "/v1/chat/completions", chat(), AUTH)
    assert (answer.status, answer.body, len(inner.bodies)) == (500, OTHER_500, 1)
    inner, ready = Failing(fails=0, stream=True), Ready(clock, [])
    answer = call(replaying(inner, ready, clock), "POST", "/v1/chat/completions", chat(), AUTH)
    assert (answer.status, answer.body) == (200, b'data: 1\n\n{"ok": true}')
    assert ready.asked == []


def test_without_a_hold_nothing_is_kept_back() -> None:
    inner = Failing(fails=1)
    app = proxy_gate.Door(inner, None, lambda: MODELS, lambda: KEY, max_body_bytes=LIMIT)
    answer = call(app, "POST", "/v1/chat/completions", chat(), AUTH)
    assert (answer.status, answer.body, len(inner.bodies)) == (500, REFUSED, 1)


@pytest.mark.parametrize(
    ("value", "hold_s"), [("", 300.0), ("120", 120.0), ("x", 300.0), ("inf", 300.0)]
)
def test_the_hold_time_comes_from_the_environment(value: str, hold_s: float) -> None:
    assert mount.hold_seconds({"B70_HOLD_S": value} if value else {}) == hold_s


def test_a_request_let_through_is_open_until_its_answer_ends(tmp_path: Any) -> None:
    """The door gives each request to the model a ticket; the hold's gate opens it when it lets
    the request through (here: the app, in LiteLLM's place), the door closes it at the end."""
    counts = hold.OpenRequests(tmp_path)
    seen: list[int | None] = []

    class Counting(Failing):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            ticket = hold.TICKET.get()
            assert ticket is not None
            ticket.open(counts)
            seen.append(hold.read_open(tmp_path))
            await super().__call__(scope, receive, send)

    answer = call(replaying(Counting(fails=0), Ready(Clock(), []), Clock()), "POST",
                  "/v1/chat/completions", chat(), AUTH)  # fmt: skip
    assert answer.status == 200
    assert seen == [1] and hold.read_open(tmp_path) == 0
    assert hold.TICKET.get() is None


# --- the fast way: LiteLLM's pass-through route (appliance.proxy.relay) ---------------------------


class Ways:
    """LiteLLM's place: the pass-through route answers `fast` (a status), the full route 200."""

    def __init__(self, fast: int = 200) -> None:
        self.fast = fast
        self.paths: list[str] = []
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.paths.append(scope["path"])
        message = await receive()
        self.bodies.append(message.get("body", b""))
        status = self.fast if scope["path"].startswith("/vllm/") else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"way %s" % scope["path"].encode()})


class Holding:
    """The request hold as the door's fast way sees it: the tokens it was given; a HoldTimeout
    when `timeout` is set."""

    def __init__(self, timeout: bool = False) -> None:
        self.timeout = timeout
        self.tokens: list[str | None] = []

    async def __call__(self, token: str | None) -> float:
        self.tokens.append(token)
        if self.timeout:
            raise waiting.HoldTimeout("switching to vllm", 120.0, 30)
        return 0.0


def fast_door(inner: Any, holding: Holding) -> proxy_gate.Door:
    return proxy_gate.Door(
        inner, None, lambda: MODELS, lambda: KEY, max_body_bytes=LIMIT,
        wait_ready=Ready(Clock(), []), hold_s=60, clock=Clock(), hold=holding,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("path", "through"),
    [("/v1/chat/completions", "/vllm/chat/completions"), ("/completions", "/vllm/completions")],
)
def test_a_checked_request_is_held_then_goes_the_fast_way(path: str, through: str) -> None:
    inner, holding = Ways(), Holding()
    body = chat() if "chat" in path else json.dumps({"model": "smollm2", "prompt": "hi"}).encode()
    headers = {**AUTH, hold.BYPASS_HEADER: "t0ken"}
    answer = call(fast_door(inner, holding), "POST", path, body, headers)
    assert (answer.status, answer.body) == (200, b"way " + through.encode())
    assert inner.paths == [through] and inner.bodies == [body]
    assert holding.tokens == ["t0ken"]


def test_a_server_error_of_the_fast_way_is_kept_back_and_the_request_goes_the_full_way() -> None:
    """The pass-through answers a bare 500 for a runtime's 4xx or a runtime that is down; the
    full way names the error (and resends a request whose runtime died)."""
    inner = Ways(fast=500)
    answer = call(fast_door(inner, Holding()), "POST", "/v1/chat/completions", chat(), AUTH)
    assert (answer.status, answer.body) == (200, b"way /v1/chat/completions")
    assert inner.paths == ["/vllm/chat/completions", "/v1/chat/completions"]
    assert inner.bodies[0] == inner.bodies[1] == chat()


def test_a_fast_request_whose_hold_runs_out_is_a_503_and_reaches_nothing() -> None:
    inner = Ways()
    answer = call(fast_door(inner, Holding(timeout=True)), "POST", "/v1/chat/completions",
                  chat(), AUTH)  # fmt: skip
    assert answer.status == 503 and answer.headers["retry-after"] == "30"
    assert answer.error["code"] == "b70_hold_timeout"
    assert (
        "switching to vllm" in answer.error["message"] and "waited 120 s" in answer.error["message"]
    )
    assert inner.paths == []


def test_models_and_refusals_never_take_the_fast_way() -> None:
    inner, holding = Ways(), Holding()
    assert call(fast_door(inner, holding), "GET", "/v1/models", b"", AUTH).status == 200
    refused = call(fast_door(inner, holding), "POST", "/v1/chat/completions", chat(max_tokens=0),
                   AUTH)  # fmt: skip
    assert refused.status == 400
    assert inner.paths == ["/v1/models"] and holding.tokens == []


def test_a_stream_whose_runtime_dies_before_its_first_event_goes_the_full_way() -> None:
    """A runtime sends a stream's status line at once; if it dies before the first event, the
    client has had nothing yet, and the full way waits for the runtime and sends it again."""

    class DiesAfterHeaders(Ways):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if not scope["path"].startswith("/vllm/"):
                await super().__call__(scope, receive, send)
                return
            self.paths.append(scope["path"])
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"", "more_body": True})
            raise RuntimeError("the runtime closed the connection")

    inner = DiesAfterHeaders()
    answer = call(fast_door(inner, Holding()), "POST", "/v1/chat/completions", chat(stream=True),
                  AUTH)  # fmt: skip
    assert (answer.status, answer.body) == (200, b"way /v1/chat/completions")
    assert inner.paths == ["/vllm/chat/completions", "/v1/chat/completions"]


def test_an_answer_that_has_begun_is_never_taken_back() -> None:
    class DiesMidStream(Ways):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            self.paths.append(scope["path"])
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            raise RuntimeError("the runtime died mid-stream")

    inner = DiesMidStream()
    with pytest.raises(RuntimeError):
        call(fast_door(inner, Holding()), "POST", "/v1/chat/completions", chat(stream=True), AUTH)
    assert inner.paths == ["/vllm/chat/completions"]
