"""The door (appliance.proxy.door) sending checked requests straight to the runtime
(appliance.proxy.direct), against a real TCP server in the test's event loop (tests/directkit.py)."""

from __future__ import annotations

import asyncio
import types
from typing import Any

from appliance.proxy import direct, mount
from appliance.proxy import door as proxy_door
from appliance.proxy.backend import CHAT
from tests import directkit
from tests.directkit import BODY, KEY, Client, Runtime, Script, answer

# --- the door ------------------------------------------------------------------------------------


class Inner:
    """LiteLLM's app: it answers 200 and keeps the bodies it got."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.bodies.append((await receive()).get("body", b""))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"the full way"})


def through_door(script: Script | None) -> tuple[Client, Inner, list[float]]:
    """One chat request through a door whose model goes straight to a scripted runtime (None:
    nothing listens); what the client got, what LiteLLM got, and the waits for the runtime."""
    client, inner, waits = Client(), Inner(), []

    async def wait_ready(limit_s: float, token: str | None) -> float:
        waits.append(limit_s)
        return 0.0

    async def hold(token: str | None) -> float:
        return 0.0

    async def scenario() -> None:
        async with Runtime(script or answer(200, b"")) as runtime:
            target = runtime.target()
            if script is None:
                runtime.server.close()  # type: ignore[union-attr]
                await runtime.server.wait_closed()  # type: ignore[union-attr]
            door = proxy_door.Door(
                inner, None, lambda: {"smollm2"}, lambda: KEY, wait_ready=wait_ready,
                hold_s=60, hold=hold, direct_to=lambda name: target,
            )  # fmt: skip
            await directkit.through(door, client, "/v1/chat/completions", BODY)

    asyncio.run(scenario())
    return client, inner, waits


def test_the_door_sends_a_checked_request_straight_to_the_runtime() -> None:
    client, inner, waits = through_door(answer(200, b'{"id": "x"}'))
    assert (client.status, client.body) == (200, b'{"id": "x"}')
    assert inner.bodies == [] and waits == []


def test_a_runtime_that_is_not_serving_holds_the_request_then_it_goes_the_full_way() -> None:
    for script in (None, answer(503, b"Loading model")):
        client, inner, waits = through_door(script)
        assert (client.status, client.body) == (200, b"the full way")
        assert inner.bodies == [BODY] and len(waits) == 1 and 59 < waits[0] <= 60


def test_a_runtime_error_goes_the_full_way_at_once() -> None:
    client, inner, waits = through_door(answer(400, b'{"error": "bad"}'))
    assert (client.status, client.body) == (200, b"the full way")
    assert inner.bodies == [BODY] and waits == []


def test_the_direct_way_passes_through_the_proxys_answer_layers_only() -> None:
    """CORS and the security headers, as the proxy's app configures them, and no other layer
    of its (a layer that fails here stands for LiteLLM's others)."""
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    class SecurityHeadersMiddleware:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def with_header(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message["headers"], (b"x-frame-options", b"DENY")]
                await send(message)

            await self.app(scope, receive, with_header)

    class Other:
        def __init__(self, app: Any) -> None:
            raise AssertionError("not an answer layer")

    server_app = types.SimpleNamespace(user_middleware=[
        Middleware(Other), Middleware(CORSMiddleware, allow_origins=["*"]),
        Middleware(SecurityHeadersMiddleware),
    ])  # fmt: skip
    wrap = mount.answer_layers(server_app)
    client = Client()

    async def scenario() -> None:
        async with Runtime(answer(200, b"{}")) as runtime:
            call = direct.Call(runtime.target(), CHAT, BODY)
            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/chat/completions",
                "headers": [(b"origin", b"https://chat.example")],
                call.SCOPE_KEY: call,
            }
            await wrap(direct.Call.endpoint)(scope, client.receive, client.send)
            assert call.way == direct.ANSWERED

    asyncio.run(scenario())
    assert client.status == 200
    assert client.headers[b"access-control-allow-origin"] == b"*"
    assert client.headers[b"x-frame-options"] == b"DENY"


def test_a_client_that_leaves_while_its_request_is_held_leaves_the_queue_at_once(
    tmp_path: Any,
) -> None:
    """Held for a runtime that does not serve (a real turnstile, its queue on disk), the client
    leaves: its place is freed then, not when the hold time runs out, and nothing is sent."""
    from appliance import hold as hold_mark
    from appliance.proxy import waiting

    async def down() -> bool:
        return False

    turnstile = waiting.Turnstile(tmp_path, down, hold_s=300, port=9)
    client, inner = Client(), Inner()

    async def scenario() -> None:
        door = proxy_door.Door(
            inner, None, lambda: {"smollm2"}, lambda: KEY, hold_s=300,
            hold=lambda token: turnstile.wait(token), direct_to=lambda name: None,
        )  # fmt: skip
        request = asyncio.ensure_future(
            directkit.through(door, client, "/v1/chat/completions", BODY)
        )
        for _ in range(50):
            await asyncio.sleep(0.01)
            if hold_mark.read_queues(tmp_path):
                break
        assert hold_mark.read_queues(tmp_path)[9].count == 1
        client.leave.set()
        await asyncio.wait_for(request, 5)

    asyncio.run(scenario())
    assert hold_mark.read_queues(tmp_path) == {}
    assert client.messages == [] and inner.bodies == []
