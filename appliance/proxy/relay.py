"""The fast way of a checked request to the model when LiteLLM's router must choose (several
deployments of the model, or one that is not the appliance's runtime): LiteLLM's vLLM
pass-through route. A model with one deployment on the appliance's runtime, as rendered, goes
straight to it instead (appliance.proxy.direct).

LiteLLM's chat and completion routes turn every request into its own objects (a `Deployment`
built for each request, a logging object, usage and cost at the end of each stream) and every
streamed chunk into pydantic objects that it serialises again; in a burst of requests that work
queues on each worker's one event loop. Its pass-through route for vLLM (`/vllm/{endpoint}`)
still authenticates the request and picks the deployment with LiteLLM's router (aliases, and
the routing strategies of several deployments), then relays the runtime's own bytes: less work
per request, and none per chunk. The runtime receives the body as the door checked it, with the
model name the router resolved, and no header of the client's.

The pass-through route answers every failure with a bare 500: a runtime that refused the
request (4xx), a runtime that is down, a runtime that died after its stream's status line and
before its first event. So the answer is kept back until its first bytes, and one that fails
before them goes the full way instead (LiteLLM's chat or completion route, the hold's hook, the
door's resending), which names the error, or waits for the runtime and sends it again. Only an
answer that has begun is never taken back.

Imported by the proxy: nothing from the rest of the controller but appliance.proxy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from appliance.proxy import ASGIApp, Message, Receive, Send, log
from appliance.proxy.backend import CHAT, COMPLETION
from appliance.proxy.checks import Refusal
from appliance.proxy.waiting import HoldTimeout

# Waits until the runtime serves again, at most the seconds given: the seconds waited; raises
# HoldTimeout, with why it held, when they run out. The token is the request's hold token (a
# switch's own request passes the switch's hold).
WaitReady = Callable[[float, str | None], Awaitable[float]]

# The pass-through's endpoint is joined to the deployment's api_base, which ends in /v1.
PASS_THROUGH = {CHAT: "/vllm/chat/completions", COMPLETION: "/vllm/completions"}


class _UntilItBegins:
    """A `send` that keeps the answer back until it has begun: its status and headers go to the
    client with the first bytes of its body. An answer that is a server error, or that fails
    before any byte of its body, is kept back whole (`kept_back`). A runtime sends a stream's
    status and headers at once, and can die before its first event."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.start: Message | None = None
        self.kept_back = False
        self.passing = False

    async def __call__(self, message: Message) -> None:
        if self.passing:
            await self.send(message)
        elif self.kept_back:
            return  # the rest of the kept-back answer
        elif message["type"] == "http.response.start":
            self.kept_back = int(message.get("status", 0)) >= 500
            self.start = message
        elif message["type"] == "http.response.body" and self.start is not None:
            if message.get("body") or not message.get("more_body", False):
                self.passing = True
                await self.send(self.start)
                await self.send(message)
        else:
            await self.send(message)


async def relay(app: ASGIApp, scope: Any, kind: str, receive: Receive, send: Send) -> bool:
    """Send the request through the pass-through route: True when its answer went to the
    client, False when it failed before its first bytes (send it the full way)."""
    path = PASS_THROUGH.get(kind)
    if path is None:
        return False
    through = {**scope, "path": path, "raw_path": path.encode()}
    kept = _UntilItBegins(send)
    try:
        await app(through, receive, kept)
    except Exception:
        # An error the route did not handle: LiteLLM's handler of those fails itself in 1.106.12
        # (it imports prisma, which the proxy does not install), so nothing was answered, or
        # Starlette answered 500 and raised it again for the server to log. Either way, before
        # any byte reached the client the full way answers instead; after, nothing can.
        if kept.passing:
            raise
        return False
    # An answer that ended without a byte of its body goes the full way too, which says why.
    return kept.passing


# --- the full way, sent again -----------------------------------------------------------------


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the body read here once, then the client's own messages (so a
    client that leaves mid-stream is still seen leaving)."""
    pending: list[bytes] = [body]

    async def replay() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replay


# What LiteLLM says when the connection to the runtime failed before any answer: aiohttp's and
# httpx's words for a refused, reset or closed connection, and the OpenAI SDK's.
CONNECTION_FAILED = (
    b"Cannot connect to host",
    b"Connection refused",
    b"Connection reset",
    b"Server disconnected",
    b"ServerDisconnectedError",
    b"RemoteProtocolError",
    b"ConnectError",
    b"Connection error",
)
REPLAYS = 2


class _HeldFailure:
    """A `send` that keeps back a 500 or 502 answer about a failed connection to the runtime;
    anything else passes through as it comes."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.start: Message | None = None
        self.body: list[bytes] = []
        self.kept_back = False
        self.passing = False

    async def __call__(self, message: Message) -> None:
        if self.passing:
            await self.send(message)
            return
        if message["type"] == "http.response.start":
            if message.get("status") in (500, 502):
                self.start = message
                return
            self.passing = True
            await self.send(message)
            return
        if message["type"] != "http.response.body" or self.start is None:
            await self.send(message)
            return
        self.body.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        text = b"".join(self.body)
        if any(words in text for words in CONNECTION_FAILED):
            self.kept_back = True  # forward() sends the request again, or release()s this
            return
        await self.release()

    async def release(self) -> None:
        """Send what was kept back, as LiteLLM gave it."""
        self.passing = True
        if self.start is not None:
            await self.send(self.start)
            await self.send({"type": "http.response.body", "body": b"".join(self.body)})


def runtime_gone(waited_s: float, hold_s: float) -> Refusal:
    retry_after = max(1, round(min(hold_s / 4, 30)))
    return Refusal(
        503, f"the model is not available: the runtime stopped answering this request and did "
        f"not serve again in time; it waited {waited_s:.0f} s. Retry after {retry_after} s.",
        "b70_hold_timeout", kind="service_unavailable",
        headers={"Retry-After": str(retry_after)},
    )  # fmt: skip


async def resend(
    app: ASGIApp, scope: Any, body: bytes, receive: Receive, send: Send, arrived: float,
    hold_s: float, wait_ready: WaitReady | None, clock: Callable[[], float], token: str | None,
    sent: int = 0,
) -> None:  # fmt: skip
    """The full way, sent again if the runtime died before answering.

    The runtime's death reaches LiteLLM as a failed connection (refused, reset, or closed
    without an answer), which it answers 500. If that happens before the client got a byte,
    the answer is kept back, the request waits like any held request until the runtime
    serves again (the hold: a restart by systemd or the monitor, or a switch), and it is
    sent again, within the hold time from its arrival. It is sent REPLAYS + 1 times at most,
    the `sent` times of the fast way before it included: a request that kills the runtime
    each time it is sent must not keep killing it. An answer that has begun (a stream's first
    event) is never taken back."""
    for attempt in range(min(sent, REPLAYS), REPLAYS + 1):
        held = _HeldFailure(send) if wait_ready is not None else None
        await app(scope, replay(body, receive), held or send)
        if held is None or not held.kept_back:
            return
        left = hold_s - (clock() - arrived)
        if attempt == REPLAYS or left <= 0:
            await held.release()
            return
        assert wait_ready is not None
        try:
            waited = await wait_ready(left, token)
        except HoldTimeout:
            await runtime_gone(clock() - arrived, hold_s).send(send)
            return
        log(
            f"b70: {scope['path']}: the runtime failed before answering; sent again "
            f"after {waited:.1f} s (attempt {attempt + 2} of {REPLAYS + 1})"
        )
