"""The door (appliance.proxy.door) as a plain ASGI app in this process, for the tests of it:
the runtime behind it answered by httpx's MockTransport in the shapes the real runtimes answer,
LiteLLM's place taken by a recorder, and one request sent through it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from appliance.proxy import backend as proxy_backend
from appliance.proxy import door as proxy_door

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
) -> tuple[proxy_door.Door, Inner]:
    inner = Inner()
    backend = None
    if runtime is not None:
        transport = httpx.MockTransport(runtime.handle)
        backend = proxy_backend.Backend("http://runtime", clock or Clock(), transport)
    door_app = proxy_door.Door(inner, backend, lambda: MODELS, lambda: KEY, max_body_bytes=limit)
    return door_app, inner


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
