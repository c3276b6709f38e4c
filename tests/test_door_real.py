"""The door (appliance.proxy.door) in the real LiteLLM proxy, installed by b70ctl under a real
systemd user manager, in front of llama-server and then vLLM: every route LiteLLM registers,
bad requests, clients that leave mid-stream, idle connections, and the proxy's memory."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from appliance.layout import MONITOR_UNIT
from tests import clientkit
from tests.conftest import (
    HF_MODEL,
    Appliance,
    demo_config_text,
    free_port,
    installed,
    require_real_parts,
    running_manager,
)

MIB = 1 << 20
ENGINE = {"llamacpp": "llama.cpp", "vllm": "vLLM"}


@pytest.fixture(scope="module")
def door_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    require_real_parts()
    root = tmp_path_factory.mktemp("door")
    proxy_port, backend_port = free_port(), free_port()
    with running_manager(root / "manager") as manager:
        cfg = root / "appliance.toml"
        cfg.write_text(demo_config_text(proxy_port, backend_port))
        # The monitor's probes would blur the figures.
        with installed(manager, cfg, proxy_port, backend_port, stop=(MONITOR_UNIT,)) as app:
            yield app
    # Only now that the manager is stopped: one whose files are gone ignores SIGTERM and lives on.
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def rss_before(door_app: Appliance) -> dict[int, int]:
    """The proxy's RSS per process once every worker has served every kind of request (so what
    they load on first use is counted before, not as growth): many connections at once, as one
    connection stays with one worker."""

    def warm(_: int) -> None:
        with client(door_app) as c:
            # The last one passes the door and the runtime refuses it: LiteLLM's full way, which
            # a worker loads only when a request first takes it.
            for body in (CHAT, {**CHAT, "stream": True}, COMPLETION, {"model": "smollm2"},
                         BAD_GRAMMAR):  # fmt: skip
                path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
                c.post(path, json=body)
            c.post("/v1/chat/completions", content=b"{")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(warm, range(24)))
    return proxy_rss(door_app)


@pytest.fixture(scope="module", params=["llamacpp", "vllm"])
def serving(request: pytest.FixtureRequest, door_app: Appliance) -> str:
    """The runtime that serves (a switch to it, if another one does)."""
    door_app.b70ctl("switch", request.param, check=True)
    return str(request.param)


CHAT: dict[str, Any] = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 4,
    "temperature": 0,
}
COMPLETION: dict[str, Any] = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4}
# A request the door lets through and the runtime refuses (a schema no grammar can hold).
BAD_GRAMMAR: dict[str, Any] = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
    "name": "x", "schema": {"type": "no-such-type"}}}}  # fmt: skip


def client(app: Appliance, key: bool = True, timeout: float = 120) -> httpx.Client:
    headers = {"Authorization": f"Bearer {app.key}"} if key else {}
    base = f"http://127.0.0.1:{app.proxy_port}"
    return httpx.Client(base_url=base, headers=headers, timeout=timeout)


def proxy_rss(app: Appliance) -> dict[int, int]:
    """RSS in bytes of the proxy's main process and its workers."""
    pid = int(app.manager.systemctl("show", "-p", "MainPID", "--value", "b70-litellm.service"))
    main = psutil.Process(pid)
    return {p.pid: p.memory_info().rss for p in [main, *main.children(recursive=True)]}


def runtime_metric(app: Appliance, names: tuple[str, ...]) -> float:
    text = httpx.get(f"http://127.0.0.1:{app.backend_port}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] in names:
            total += float(line.rsplit(" ", 1)[1])
    return total


RUNNING = ("llamacpp:requests_processing", "vllm:num_requests_running")
WORK_DONE = (  # tokens the runtime has read or written, ever
    "llamacpp:prompt_tokens_total",
    "llamacpp:tokens_predicted_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


# --- the routes ---------------------------------------------------------------------------------

ENUMERATE = r"""
import json, os
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
from fastapi.routing import iter_route_contexts
from starlette.routing import Mount
from litellm.proxy import proxy_server, _lazy_features as lazy
app = proxy_server.app
lazy.register_all_features(app, lazy.LAZY_FEATURES)  # the routers LiteLLM loads on first use too
out = []
def walk(routes, prefix):
    for context in iter_route_contexts(routes):
        route = context.original_route
        path = prefix + (context.path or "")
        if isinstance(route, Mount):
            out.append({"path": path, "kind": "mount", "methods": []})
            walk(getattr(route.app, "routes", None) or [], path)
        else:
            kind = "websocket" if "WebSocket" in type(route).__name__ else "http"
            out.append({"path": path, "kind": kind, "methods": sorted(context.methods or [])})
walk(app.routes, "")
print(json.dumps(out))
"""


def litellm_routes() -> list[dict[str, Any]]:
    """Every route LiteLLM 1.106.12 registers, mounts and what they hold included."""
    out = subprocess.run(
        [sys.executable, "-c", ENUMERATE], capture_output=True, text=True, check=True, timeout=300
    )
    routes: list[dict[str, Any]] = json.loads(out.stdout.splitlines()[-1])
    return routes


def sample_paths(route: dict[str, Any]) -> list[str]:
    """Concrete paths that reach a route: its parameters filled with the served model's name."""
    path = re.sub(r"\{[^}]*\}", "smollm2", route["path"]) or "/"
    if route["kind"] == "mount":
        return [path.rstrip("/") + "/", path.rstrip("/") + "/index.html"]
    return [path]


ALLOWED = {
    "/chat/completions", "/v1/chat/completions", "/completions", "/v1/completions",
    "/models", "/v1/models", "/models/smollm2", "/v1/models/smollm2",
    "/health/liveliness", "/health/liveness", "/health/readiness",
    "/v1/responses", "/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/embeddings", "/embeddings", "/v1/rerank", "/rerank", "/tokenize", "/detokenize",
}  # fmt: skip
NAMED_IN_THE_ISSUE = [
    "/", "/ui", "/ui/", "/openapi.json", "/docs", "/redoc", "/model/new", "/config/update",
    "/key/generate", "/settings", "/debug/asyncio-tasks", "/spend/logs", "/global/spend/logs",
    "/health", "/metrics", "/routes",
]  # fmt: skip


def test_the_door_serves_exactly_the_appliance_routes(
    door_app: Appliance, rss_before: dict[int, int]
) -> None:
    routes = litellm_routes()
    assert len(routes) > 500, "LiteLLM registers hundreds of routes: the walk found them all"
    requests: set[tuple[str, str, str]] = set()  # (method, path, kind)
    for route in routes:
        methods = route["methods"] or ["GET"]
        for path in sample_paths(route):
            requests |= {(m, path, route["kind"]) for m in methods}
    requests |= {(m, path, "http") for path in NAMED_IN_THE_ISSUE for m in ("GET", "POST")}
    # The runtimes' own routes that LiteLLM does not register, and the door opens
    requests |= {
        (m, path, "http") for path in ("/tokenize", "/detokenize") for m in ("GET", "POST")
    }
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"}
    upgrade["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
    answered: dict[tuple[bool, str], set[int]] = {}
    for key in (False, True):
        with client(door_app, key=key, timeout=30) as c:
            for method, path, kind in sorted(requests):
                extra = {"headers": upgrade} if kind == "websocket" else {}
                body = {"content": b"{}"} if method in ("POST", "PUT", "PATCH") else {}
                response = c.request(method, path, **extra, **body)
                if kind == "websocket":  # LiteLLM's websockets (/v1/responses, /v1/realtime)
                    assert response.status_code == 404, (path, response.status_code)
                    continue
                answered.setdefault((key, path), set()).add(response.status_code)
                if response.status_code == 404 and method != "HEAD":
                    assert response.json()["error"]["code"] in ("not_found", "model_not_found")
    for key in (False, True):
        open_paths = {path for (k, path), codes in answered.items() if k == key and codes != {404}}
        assert open_paths == ALLOWED, f"with{'' if key else 'out'} the key"
    for path in ALLOWED - {p for p in ALLOWED if p.startswith("/health")}:
        assert 404 not in answered[(False, path)] and answered[(False, path)] <= {401, 405}
    print(
        f"\n{len(routes)} routes, {len(requests)} method and path pairs, each with and without the key"
    )


# --- bad requests -------------------------------------------------------------------------------


def over_context_chat() -> dict[str, Any]:
    text = "The quick brown fox jumps over the lazy dog. " * 400  # ~4000 tokens, ~18 KB
    return {**CHAT, "messages": [{"role": "user", "content": text}]}


BAD: list[tuple[str, str, dict[str, Any], int, str, str]] = [
    # name, path, httpx arguments, status, code, words in the message
    ("50 MB body", "/v1/chat/completions", {"content": b"a" * (50 * MIB)}, 413,
     "request_too_large", "the request body is 52428800 bytes, more than the 8388608 bytes"),
    ("50 MB chunked", "/v1/chat/completions",
     {"content": lambda: iter([b"a" * MIB] * 50)}, 413, "request_too_large", "more than the"),
    ("malformed JSON", "/v1/chat/completions", {"content": b'{"model": "smollm2",'}, 400,
     "invalid_json", "not valid JSON"),
    ("not an object", "/v1/completions", {"content": b'["smollm2"]'}, 400, "invalid_type",
     "must be a JSON object, not an array"),
    ("unknown model", "/v1/chat/completions", {"json": {**CHAT, "model": "gpt-4"}}, 404,
     "model_not_found", "The model `gpt-4` does not exist. This appliance serves: default, smollm2."),
    ("messages a string", "/v1/chat/completions", {"json": {**CHAT, "messages": "hello"}}, 400,
     "invalid_type", "messages must be a non-empty array of message objects, not a string"),
    ("messages empty", "/v1/chat/completions", {"json": {**CHAT, "messages": []}}, 400,
     "invalid_type", "not an empty array"),
    ("max_tokens -1", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": -1}}, 400,
     "integer_below_min_value", "max_tokens must be at least 1, not -1"),
    ("max_tokens 0", "/v1/completions", {"json": {**COMPLETION, "max_tokens": 0}}, 400,
     "integer_below_min_value", "max_tokens must be at least 1, not 0"),
    ("max_tokens 1.5", "/v1/completions", {"json": {**COMPLETION, "max_tokens": 1.5}}, 400,
     "invalid_type", "max_tokens must be an integer, not a number"),
    ("max_tokens 100000000", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": 10**8}},
     400, "integer_above_max_value", "max_tokens is 100000000, more than the context of the "
     "runtime that serves ({engine}): {context} tokens"),
    ("max_completion_tokens 100000000", "/v1/chat/completions",
     {"json": {**CHAT, "max_tokens": None, "max_completion_tokens": 10**8}}, 400,
     "integer_above_max_value", "max_completion_tokens is 100000000"),
    ("prompt over the context", "/v1/chat/completions", {"json": over_context_chat()}, 400,
     "context_length_exceeded", "tokens, more than the context of the runtime that serves"),
    ("token ids over the context", "/v1/completions",
     {"json": {**COMPLETION, "prompt": [42] * 5000}}, 400, "context_length_exceeded",
     "this prompt is 5000 tokens"),
    ("text over the context", "/v1/completions",
     {"json": {**COMPLETION, "prompt": "hello " * 5000}}, 400, "context_length_exceeded",
     "tokens, more than the context"),
]  # fmt: skip


def runtime_context(app: Appliance, runtime: str) -> int:
    """The context of one request, as the runtime itself says it."""
    base = f"http://127.0.0.1:{app.backend_port}"
    if runtime == "vllm":
        return int(httpx.get(base + "/v1/models").json()["data"][0]["max_model_len"])
    props = httpx.get(base + "/props").json()
    return int(props["default_generation_settings"]["n_ctx"])


def test_bad_requests_get_a_clear_error_at_once_and_never_reach_the_runtime(
    door_app: Appliance, serving: str, rss_before: dict[int, int]
) -> None:
    context = runtime_context(door_app, serving)
    with client(door_app) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200  # the door knows it
        work = runtime_metric(door_app, WORK_DONE)
        report = []
        for name, path, arguments, status, code, says in BAD:
            arguments = {k: v() if callable(v) else v for k, v in arguments.items()}
            start = time.monotonic()
            response = c.post(path, **arguments)
            seconds = time.monotonic() - start
            assert response.status_code == status, (name, response.text)
            assert response.headers["content-type"] == "application/json", name
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert error["code"] == code, (name, error)
            assert error["type"] == "invalid_request_error", name
            assert says.format(engine=ENGINE[serving], context=context) in error["message"], error
            assert seconds < (3.0 if "50 MB" in name else 1.0), (name, seconds)
            report.append(f"{name}: {status} in {seconds * 1000:.0f} ms: {error['message']}")
        assert runtime_metric(door_app, WORK_DONE) == work, "the runtime never saw one of them"
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200, "and still serves"
    print(f"\n{serving} (context {context}):\n" + "\n".join(report))


def test_what_the_runtime_refuses_names_the_runtime(door_app: Appliance, serving: str) -> None:
    """A request the door lets through and the runtime refuses: the error names the runtime."""
    with client(door_app) as c:
        response = c.post("/v1/chat/completions", json=BAD_GRAMMAR)
    assert 400 <= response.status_code < 500, response.text
    message = response.json()["error"]["message"]
    assert f"the runtime ({ENGINE[serving]})" in message
    assert "Hosted_vllm" not in message


# LiteLLM's layers that shape every answer's headers, as its own routes give them.
LAYER_HEADERS = (
    "access-control-allow-origin",
    "access-control-expose-headers",
    "x-frame-options",
    "content-security-policy",
    "x-content-type-options",
)


def test_a_model_request_goes_straight_to_the_runtime_with_the_proxys_answer_headers(
    door_app: Appliance, serving: str
) -> None:
    """The door sends a checked request to the runtime itself: its answer has none of the
    x-litellm-* headers LiteLLM's chat and pass-through routes add, an alias reaches the runtime
    under the name it serves, and a browser gets the CORS and security headers that LiteLLM's
    own routes give (its layers, as the proxy configures them)."""
    origin = {"Origin": "https://chat.example"}
    with client(door_app) as c:
        models = c.get("/v1/models", headers=origin)
        assert models.status_code == 200 and models.headers["access-control-allow-origin"]
        for body in (CHAT, {**CHAT, "model": "default"}, {**CHAT, "stream": True}, COMPLETION):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            r = c.post(path, json=body, headers=origin)
            assert r.status_code == 200, r.text
            assert [h for h in r.headers if h.startswith("x-litellm")] == [], body
            for name in LAYER_HEADERS:
                assert r.headers.get(name) == models.headers.get(name), (name, body)
            if not body.get("stream"):
                assert r.json()["model"] == "smollm2"


# --- every API, with the clients people use ------------------------------------------------------


def test_the_clients_people_use_speak_every_api_through_the_door(
    door_app: Appliance, serving: str, tmp_path: Path
) -> None:
    door = clientkit.Door(door_app.proxy_port, door_app.key, tmp_path)
    said = [speak(door) for speak in clientkit.GENERATING]
    if serving == "llamacpp":  # started with --embeddings --pooling mean (examples/demo.toml)
        said += [speak(door) for speak in clientkit.EMBEDDING]
    else:  # vLLM serving a generative model: a clear 501, in OpenAI's shape
        with pytest.raises(openai.APIStatusError) as refused:
            clientkit.openai_embeddings(door)
        assert refused.value.status_code == 501
        assert "vLLM serves embeddings only when it runs an embedding model" in str(refused.value)
        said.append(f"embeddings: 501 {refused.value.message}")
        with pytest.raises(openai.APIStatusError) as refused:  # LangChain's client is OpenAI's
            clientkit.langchain_embeddings(door)
        assert refused.value.status_code == 501
        said.append("langchain embeddings: the same 501")
    with client(door_app) as c:
        tokens = c.post("/tokenize", json={"model": "smollm2", "content": "Say hi"})
        assert tokens.status_code == 200 and tokens.json()["tokens"], tokens.text
        text = c.post("/detokenize", json={"model": "smollm2", "tokens": tokens.json()["tokens"]})
        assert "Say hi" in (text.json().get("content") or text.json().get("prompt")), text.text
        rerank = {"model": "smollm2", "query": "a cat", "documents": ["a cat", "a city"]}
        refused_rerank = c.post("/v1/rerank", json=rerank)  # neither demo runtime serves rerank
        assert refused_rerank.status_code == 501
        assert (
            f"{ENGINE[serving]} serves rerank only when"
            in refused_rerank.json()["error"]["message"]
        )
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    entry = listed["smollm2"]
    assert entry["serving_runtime"] == serving, entry
    assert {"chat.completions", "responses", "messages"} <= set(entry["apis"])
    assert ("embeddings" in entry["apis"]) == (serving == "llamacpp")
    assert set(entry["apis_by_runtime"]) == {"llamacpp", "vllm"}
    print(f"\n{serving}:\n" + "\n".join(said))


BAD_API: list[tuple[str, str, dict[str, Any], int, str]] = [
    # name, path, body, status, words in the message (in the API's own error shape)
    ("a chat body on Responses", "/v1/responses", CHAT, 400, "input is missing"),
    ("Responses over the context", "/v1/responses",
     {"model": "smollm2", "input": "x " * 300_000}, 400, "more than the context"),
    ("max_output_tokens 0", "/v1/responses", {"model": "smollm2", "input": "hi",
     "max_output_tokens": 0}, 400, "max_output_tokens must be at least 1"),
    ("Messages without max_tokens", "/v1/messages", {**CHAT, "max_tokens": None}, 400,
     "max_tokens is missing"),
    ("Messages with an unknown model", "/v1/messages", {**CHAT, "model": "claude-x"}, 404,
     "The model `claude-x` does not exist"),
    ("empty embeddings input", "/v1/embeddings", {"model": "smollm2", "input": []}, 400,
     "not an empty array"),
    ("3000 embeddings inputs", "/v1/embeddings", {"model": "smollm2", "input": ["a"] * 3000},
     400, "more than the 2048 one request takes"),
    ("rerank without documents", "/v1/rerank", {"model": "smollm2", "query": "q"}, 400,
     "documents is missing"),
    ("tokenize without text", "/tokenize", {"model": "smollm2"}, 400, "content is missing"),
]  # fmt: skip


def test_a_bad_request_to_any_api_is_a_quick_4xx_in_its_shape_and_never_reaches_the_runtime(
    door_app: Appliance, serving: str
) -> None:
    with client(door_app) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200  # the door knows it
        work = runtime_metric(door_app, WORK_DONE)
        for name, path, body, status, says in BAD_API:
            start = time.monotonic()
            response = c.post(path, json={k: v for k, v in body.items() if v is not None})
            seconds = time.monotonic() - start
            assert response.status_code == status, (name, response.text)
            if path.startswith("/v1/messages"):
                assert response.json()["type"] == "error", name
            error = response.json()["error"]
            assert says in error["message"], (name, error)
            assert seconds < 1.0, (name, seconds)
        wrong_type = c.post(
            "/v1/messages",
            content=b"a=b",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert wrong_type.status_code == 415 and wrong_type.json()["type"] == "error"
        assert runtime_metric(door_app, WORK_DONE) == work, "the runtime never saw one of them"
        assert (
            c.post(
                "/v1/responses", json={"model": "smollm2", "input": "hi", "max_output_tokens": 4}
            ).status_code
            == 200
        )


# --- clients that leave, clients that wait --------------------------------------------------------


def test_a_client_that_leaves_mid_stream_frees_its_slot(
    door_app: Appliance, serving: str, rss_before: dict[int, int]
) -> None:
    long = {**CHAT, "max_tokens": 900, "stream": True, "ignore_eos": True}  # within 1024
    long["messages"] = [{"role": "user", "content": "Count from 1 to 2000, one number a line."}]
    for _ in range(3):
        with client(door_app) as c, c.stream("POST", "/v1/chat/completions", json=long) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: leaving a loop over it would close the connection
            chunks = 0
            while chunks < 10:
                chunks += next(lines).startswith("data: ")
            running = time.monotonic()
            while (now := runtime_metric(door_app, RUNNING)) != 1:  # vLLM's gauge lags a little
                assert time.monotonic() - running < 10, f"the stream runs in the runtime: {now}"
                time.sleep(0.05)
            before = runtime_metric(door_app, WORK_DONE)
        left = time.monotonic()  # the connection is closed here, mid-stream
        while runtime_metric(door_app, RUNNING) != 0:
            assert time.monotonic() - left < 10, "the runtime still works for a client that left"
            time.sleep(0.05)
        freed_s = time.monotonic() - left
        generated = runtime_metric(door_app, WORK_DONE) - before
        assert generated < 600, "it stopped long before the 900 tokens it was asked for"
        print(f"\n{serving}: slot free {freed_s * 1000:.0f} ms after the client left")


def test_500_idle_connections_do_not_stop_a_normal_request(
    door_app: Appliance, serving: str, rss_before: dict[int, int]
) -> None:
    idle = []
    try:
        for i in range(500):
            s = socket.create_connection(("127.0.0.1", door_app.proxy_port), timeout=10)
            if i % 2:  # half of them send half a request and stop
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: b70\r\nContent-Len")
            idle.append(s)
        start = time.monotonic()
        with client(door_app, timeout=60) as c:
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
            assert c.get("/health/liveliness").status_code == 200
        seconds = time.monotonic() - start
        assert seconds < 30
        still_open = sum(1 for s in idle if still_connected(s))
        print(
            f"\nanswered in {seconds:.2f} s beside 500 idle connections ({still_open} still open)"
        )
    finally:
        for s in idle:
            s.close()


def still_connected(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


# --- and the proxy's memory after all of this ---------------------------------------------------


def test_the_proxy_rss_after_all_of_this_is_within_ten_percent(
    door_app: Appliance, serving: str, rss_before: dict[int, int]
) -> None:
    with client(door_app) as c:
        for _ in range(5):
            for _name, path, arguments, *_ in BAD:
                c.post(path, **{k: v() if callable(v) else v for k, v in arguments.items()})
            huge = {**CHAT, "messages": [{"role": "user", "content": "x" * (8 * MIB - 200)}]}
            assert c.post("/v1/chat/completions", json=huge).status_code == 400
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    time.sleep(1)
    after = proxy_rss(door_app)
    assert set(after) == set(rss_before), "the same processes: no worker was restarted"
    before_mib, after_mib = sum(rss_before.values()) / MIB, sum(after.values()) / MIB
    per_process = ", ".join(
        f"{pid}: {rss_before[pid] / MIB:.0f} -> {after[pid] / MIB:.0f} MiB" for pid in after
    )
    print(f"\nproxy RSS {before_mib:.1f} MiB -> {after_mib:.1f} MiB ({per_process})")
    assert after_mib <= before_mib * 1.10, per_process


def test_plan_compares_itself_with_the_cache_vllm_reports(
    door_app: Appliance, serving: str
) -> None:
    """Given the cache vLLM measured and its block size, the plan's layout is vLLM's: the same
    blocks and tokens, and the requests that fit within one of vLLM's own (fractional) count."""
    base = ["plan", str(HF_MODEL / "config.json"), "--compare"]
    url = f"http://127.0.0.1:{door_app.backend_port}"
    first = door_app.b70ctl(*base, url, "--json")
    if serving != "vllm":
        assert first.returncode == 1 and "Traceback" not in first.stderr
        assert (
            "has no vllm:cache_config_info: not a vLLM"
            in json.loads(first.stdout)["error"]["message"]
        )
        return
    rows = {r["what"]: r for r in json.loads(first.stdout)["result"]["compared"]["rows"]}
    cache_gib = rows["cache on each card, GiB"]["reported"]
    block = int(rows["block size (tokens)"]["reported"])
    second = door_app.b70ctl(
        *base, url, "--kv-cache-gib", repr(cache_gib), "--block-size", str(block), "--json"
    )
    doc = json.loads(second.stdout)["result"]
    rows = {r["what"]: r for r in doc["compared"]["rows"]}
    assert rows["blocks"]["apart"] == 0 and rows["tokens the cache holds"]["apart"] == 0, rows
    (fit,) = [r for w, r in rows.items() if w.startswith("requests of ")]
    # vLLM divides the cache's tokens by the length; the plan counts whole requests and keeps the
    # block pool's null block out.
    assert abs(fit["planned"] - fit["reported"]) < 1, rows
    text = door_app.b70ctl(
        *base, url, "--kv-cache-gib", repr(cache_gib), "--block-size", str(block)
    )
    assert f"against the vLLM at {url}:" in text.stdout and "+0.0%" in text.stdout
