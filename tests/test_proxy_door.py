"""The door (appliance.proxy.door), called as a plain ASGI app in this process: routes, the key,
the body limit, the request checks and installing it (tests/doorkit.py; tests/test_door_real.py
asks the real runtimes)."""

from __future__ import annotations

import gc
import json
import re
import ssl
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from appliance.proxy import backend, chain, mount
from appliance.proxy import door as proxy_door
from tests import doorkit
from tests.conftest import REPO
from tests.doorkit import AUTH, KEY, LIMIT, MODELS, Inner, call, chat, door

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
    "/v1/responses/resp_1", "/v1/responses/compact", "/v1/realtime", "/v1/messages/batches",
    "/v2/rerank", "/v1/tokenize", "/v1/score", "/utils/token_counter", "/vllm/v1/responses",
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
    door_app, inner = door()
    for method in ("GET", "POST", "DELETE"):
        answer = call(door_app, method, path, chat(), headers)
        assert answer.status == 404, (method, path)
        assert answer.headers["content-type"] == "application/json"
        assert answer.error["code"] == "not_found"
        assert answer.received == 0, "a closed path reads nothing"
    assert inner.calls == []


@pytest.mark.parametrize(("method", "path"), ALLOWED)
def test_the_allowed_routes_reach_litellm(method: str, path: str) -> None:
    door_app, inner = door()
    body = {"POST": chat(prompt="hi"), "GET": b""}[method]
    answer = call(door_app, method, path, body, AUTH)
    assert answer.status == 200, answer.body
    assert inner.calls[0][0] == path


def test_an_allowed_path_with_another_method_is_405() -> None:
    door_app, inner = door()
    answer = call(door_app, "GET", "/v1/chat/completions", headers=AUTH)
    assert answer.status == 405
    assert answer.headers["allow"] == "OPTIONS, POST"
    assert call(door_app, "POST", "/v1/models/smollm2", chat(), AUTH).status == 405
    assert inner.calls == []


def test_any_model_path_passes_while_the_served_names_are_not_known() -> None:
    inner = Inner()
    door_app = proxy_door.Door(inner, None, lambda: None, lambda: KEY)
    assert call(door_app, "GET", "/v1/models/anything", headers=AUTH).status == 200
    assert call(door_app, "GET", "/v1/models/a/b", headers=AUTH).status == 404


def test_the_route_table_is_the_appliances() -> None:
    """Beside these, GET /v1/models/{name} for the names served (tests/test_door_real.py walks
    every route LiteLLM registers against the running proxy)."""
    assert set(chain.ROUTES) == {
        "/chat/completions", "/v1/chat/completions", "/completions", "/v1/completions",
        "/models", "/v1/models", "/health/liveliness", "/health/liveness", "/health/readiness",
        "/v1/responses", "/responses", "/v1/messages", "/v1/messages/count_tokens",
        "/v1/embeddings", "/embeddings", "/v1/rerank", "/rerank", "/tokenize", "/detokenize",
    }  # fmt: skip


def test_docs_proxy_md_lists_exactly_the_routes_the_door_opens() -> None:
    """The route table at the top of docs/proxy.md, read as a user reads it."""
    text = (REPO / "docs" / "proxy.md").read_text()
    table = text.split("| route | methods | key |", 1)[1].split("\n\n", 1)[0]
    listed = set()
    for row in table.splitlines()[2:]:
        cell = row.split("|")[1]
        listed |= {p for p in re.findall(r"`(/[^`]*)`", cell) if "NAME" not in p}
    assert listed == set(chain.ROUTES)


def test_probes_need_no_key_and_everything_else_does() -> None:
    door_app, inner = door()
    assert call(door_app, "GET", "/health/liveliness").status == 200
    for method, path in ALLOWED:
        if path.startswith("/health"):
            continue
        for headers, says in (({}, "no API key"), ({"authorization": "Bearer no"}, "not the")):
            answer = call(door_app, method, path, chat(), headers)
            assert answer.status == 401, path
            assert answer.headers["www-authenticate"] == "Bearer"
            assert says in answer.error["message"]
            assert answer.error["type"] == "authentication_error"
            assert answer.received == 0, "the body of a request without the key is not read"
    assert [p for p, _ in inner.calls] == ["/health/liveliness"]


def test_a_root_path_is_routed_as_starlette_routes_it() -> None:
    scope = {"path": "/api/v1/models", "root_path": "/api"}
    assert chain.route_path(scope) == "/v1/models"
    assert chain.route_path({"path": "/apiv1/models", "root_path": "/api"}) == "/apiv1/models"


# --- the body -----------------------------------------------------------------------------------


def test_a_declared_length_over_the_limit_is_413_before_the_body_is_read() -> None:
    door_app, inner = door()
    answer = call(door_app, "POST", "/v1/chat/completions", b"", {**AUTH, "content-length": "1001"})
    assert answer.status == 413
    assert answer.error["code"] == "request_too_large"
    assert answer.error["message"].startswith(
        "the request body is 1001 bytes, more than the 1000 bytes"
    )
    assert answer.received == 0
    assert inner.calls == []


def test_a_chunked_body_is_counted_as_it_comes_and_refused_past_the_limit() -> None:
    door_app, inner = door()
    chunks = [b"x" * 400] * 10  # 4000 bytes, no Content-Length
    answer = call(door_app, "POST", "/v1/chat/completions", chunks, AUTH)
    assert answer.status == 413
    assert answer.received == 3, "refused at the chunk that passes 1000 bytes, not at the end"
    assert inner.calls == []


def test_a_body_at_the_limit_passes_whole_and_the_client_is_still_heard_after_it() -> None:
    door_app, inner = door()
    body = chat(pad="x" * 10)
    body = body[:-1] + b" " * (LIMIT - len(body)) + b"}"
    assert len(body) == LIMIT
    chunks = [body[:300], body[300:]]
    assert call(door_app, "POST", "/v1/chat/completions", chunks, AUTH).status == 200
    assert inner.calls == [("/v1/chat/completions", body)]
    assert inner.after_body == [{"type": "http.disconnect"}]


def test_a_client_that_leaves_while_sending_gets_nothing() -> None:
    door_app, inner = door()
    answer = call(door_app, "POST", "/v1/chat/completions", [b'{"model": ', b"x"], AUTH, leave=True)
    assert (answer.status, answer.body, answer.received) == (0, b"", 3)
    assert inner.calls == []


@pytest.mark.parametrize(
    "media_type", ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_body_sent_as_a_form_is_415_before_it_is_read(media_type: str) -> None:
    door_app, inner = door()
    answer = call(
        door_app, "POST", "/v1/chat/completions", chat(), AUTH | {"content-type": media_type}
    )
    assert answer.status == 415
    assert "Content-Type: application/json" in answer.error["message"]
    assert answer.received == 0 and inner.calls == []
    headers = AUTH | {"content-type": "application/json; charset=utf-8"}
    assert call(door_app, "POST", "/v1/chat/completions", chat(), headers).status == 200


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
    door_app, inner = door()
    answer = call(door_app, "POST", "/v1/chat/completions", body, AUTH)
    assert answer.status == status, answer.body
    assert answer.error["code"] == code
    assert says in answer.error["message"]
    assert answer.error["type"] == "invalid_request_error"
    assert inner.calls == []


@pytest.mark.parametrize("prompt", ["", "hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompts_of_every_kind_pass(prompt: Any) -> None:
    door_app, _ = door()
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": 4}).encode()
    assert call(door_app, "POST", "/v1/completions", body, AUTH).status == 200


@pytest.mark.parametrize("prompt", [None, [], 5, [1, "a"], [[]], [[1], "a"], {"text": "x"}])
def test_completion_prompts_of_no_kind_are_400(prompt: Any) -> None:
    door_app, _ = door()
    fields = {"model": "smollm2", "max_tokens": 4} | ({"prompt": prompt} if prompt else {})
    answer = call(door_app, "POST", "/v1/completions", json.dumps(fields).encode(), AUTH)
    assert answer.status == 400
    assert answer.error["param"] == "prompt"


# --- installing it ------------------------------------------------------------------------------


def starlette_app() -> Starlette:
    async def hello(request: Any) -> JSONResponse:
        return JSONResponse({"path": request.url.path})

    return Starlette(routes=[Route(p, hello) for p in ("/v1/models", "/key/generate")])


def test_install_wraps_a_built_stack_in_place_and_an_unbuilt_one_when_it_is_built() -> None:
    made: list[Any] = []

    def make(inner: Any) -> proxy_door.Door:
        made.append(inner)
        return proxy_door.Door(inner, None, lambda: MODELS, lambda: KEY)

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


def test_the_loaded_heap_is_left_out_of_later_collections() -> None:
    """A worker's full collections would walk all of LiteLLM (450-530 ms, docs/proxy.md)."""
    assert gc.get_freeze_count() == 0
    try:
        mount.freeze_the_loaded_heap()
        assert gc.get_freeze_count() > 10000
    finally:
        gc.unfreeze()


def test_clients_of_plain_http_addresses_build_no_tls_context() -> None:
    """httpx verifies TLS against its CA bundle, whose loading held the worker's loop for
    17-38 ms; the appliance's own addresses are http://, and https:// keeps the check."""
    # httpcore's pool keeps the context it was given (httpx 0.28, httpcore 1.0)
    plain = backend.client_for("http://127.0.0.1:8001")
    secure = backend.client_for("https://peer.example:8000")
    assert plain._transport._pool._ssl_context.verify_mode == ssl.CERT_NONE  # type: ignore[attr-defined]
    assert secure._transport._pool._ssl_context.verify_mode == ssl.CERT_REQUIRED  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("value", "limit"),
    [("", chain.DEFAULT_MAX_BODY_BYTES), ("1048576", 1048576), ("0", 8 << 20), ("x", 8 << 20)],
)
def test_the_body_limit_comes_from_the_environment(value: str, limit: int) -> None:
    assert mount.max_body_bytes({"B70_MAX_BODY_BYTES": value}) == limit


def test_the_chain_states_the_order_and_the_first_refusal_is_the_answer() -> None:
    """appliance.proxy.chain.CHAIN: clear, route, key, size, shape, API, limits, turns, hold.
    A request wrong at several of them gets the refusal of the first."""
    names = [check.__name__.removeprefix("check_") for check in chain.CHAIN]
    assert names == ["clear", "route", "key", "size", "shape", "api", "limits", "turns", "hold"]
    runtime = doorkit.Runtime("llamacpp", context=64)
    app, inner = doorkit.door(runtime, limit=1000)
    big, over = (
        b"x" * 2000,
        json.dumps(
            {"model": "smollm2", "messages": [{"role": "user", "content": "x " * 400}]}
        ).encode(),
    )
    form = {"content-type": "application/x-www-form-urlencoded"}
    cases = [
        ("GET", "/v1/chat/completions", big, {}, 405),  # the route (its method), before the key
        ("POST", "/v1/chat/completions", big, {}, 401),  # the key, before the size
        ("POST", "/v1/chat/completions", big, {**doorkit.AUTH, **form}, 415),  # a form: size
        ("POST", "/v1/chat/completions", big, doorkit.AUTH, 413),  # the size, before the shape
        ("POST", "/v1/chat/completions", b"{", doorkit.AUTH, 400),  # the shape, before the API
        ("POST", "/v1/chat/completions", over, doorkit.AUTH, 400),  # the API: over the context
    ]
    for method, path, body, headers, status in cases:
        answer = doorkit.call(app, method, path, body, headers)
        assert answer.status == status, (method, path, headers, answer.status, answer.body)
    assert json.loads(answer.body)["error"]["code"] == "context_length_exceeded"
    assert inner.calls == []
