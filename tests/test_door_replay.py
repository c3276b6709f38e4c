"""The door sends again a request whose runtime died before it answered, and sends checked
requests the fast way (appliance.proxy.relay), in this process (tests/doorkit.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance import hold
from appliance.proxy import door as proxy_door
from appliance.proxy import mount, relay, waiting
from tests.doorkit import AUTH, KEY, LIMIT, MODELS, Clock, call, chat

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

    async def __call__(self, limit_s: float, token: str | None) -> float:
        self.asked.append(limit_s)
        self.tokens.append(token)
        waited = self.waits.pop(0) if self.waits else 0.0
        if waited is None:
            self.clock.now += limit_s
            raise waiting.HoldTimeout("the backend is not healthy", limit_s, 15)
        self.clock.now += waited
        return waited


def replaying(inner: Any, ready: Ready, clock: Clock, hold_s: float = 60) -> proxy_door.Door:
    return proxy_door.Door(
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
    app = proxy_door.Door(inner, None, lambda: MODELS, lambda: KEY, max_body_bytes=LIMIT)
    answer = call(app, "POST", "/v1/chat/completions", chat(), AUTH)
    assert (answer.status, answer.body, len(inner.bodies)) == (500, REFUSED, 1)


@pytest.mark.parametrize(
    ("value", "hold_s"), [("", 300.0), ("120", 120.0), ("x", 300.0), ("inf", 300.0)]
)
def test_the_hold_time_comes_from_the_environment(value: str, hold_s: float) -> None:
    assert mount.hold_seconds({"B70_HOLD_S": value} if value else {}) == hold_s


def test_a_request_let_through_is_open_until_its_answer_ends(tmp_path: Any) -> None:
    """The door gives each request to the model a ticket; the turnstile opens it when it lets
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


def fast_door(inner: Any, holding: Holding) -> proxy_door.Door:
    return proxy_door.Door(
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
