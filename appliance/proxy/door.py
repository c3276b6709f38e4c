"""The door of the appliance: an ASGI layer in front of LiteLLM's app, in every proxy worker.

Port 8000 serves only the appliance's own routes, and checks every request to the model before
LiteLLM parses it, so a bad request costs the runtime nothing. The checks are one ordered list,
appliance.proxy.chain.CHAIN: the connection in clear, the route, the key, the body's size, its
shape, its API against the serving runtime, the key's limits, fair turns, and the hold. The door
runs the list and forwards what passes it.

Then the request goes on the fast way: straight to the runtime when the model has one
deployment on it (appliance.proxy.direct), else LiteLLM's pass-through route
(appliance.proxy.relay); or, when that fails before its answer begins, the full way: LiteLLM
reads the body from what was read here, and the client's own messages after it (so
a client that leaves mid-stream is still seen leaving, and its request cancelled in the runtime).
Every refusal is JSON in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, or
on Anthropic's routes in its shape, {"type": "error", "error": {"type", "message"}}.

How the layer is put in front: LiteLLM's app is a FastAPI app, whose Starlette base builds
`app.middleware_stack` on its first ASGI call (the lifespan start-up) and reads that attribute on
every call after. The proxy imports appliance.proxy.hook inside that lifespan, when it loads
its config, and the hook calls appliance.proxy.mount.install_in_proxy(): the built stack is
wrapped in place. If the
stack is not built yet, `build_middleware_stack` is wrapped instead, so it is wrapped whenever it
gets built. Filtering `app.router.routes` instead would not hold: LiteLLM adds routes after
start-up (lazy features register their routers on the first request to their prefix, and the
lifespan adds pass-through endpoints), and the body checks need a layer before LiteLLM's parsing
anyway. The outermost layer also sees each path before any of LiteLLM's middleware can rewrite
it.

Imported by the proxy: of the rest of the controller, only the core modules it shares with
the chain (appliance.people, appliance.usage; appliance.hold through appliance.proxy.chain).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from appliance.people import KeyRing
from appliance.proxy import ASGIApp, Receive, Send, apis, direct, log
from appliance.proxy.apis import models, streams
from appliance.proxy.apis.answers import not_served, runtime_error
from appliance.proxy.backend import Backend
from appliance.proxy.chain import (
    DEFAULT_MAX_BODY_BYTES,
    MODEL_PREFIXES,
    Checked,
    Direct,
    Disconnected,
    Gate,
    Hold,
    HoldNow,
    Request,
    Scope,
    hold_timeout,
    route_path,
    unless_left,
)
from appliance.proxy.checks import SHAPE, Refusal
from appliance.proxy.relay import (
    PASS_THROUGH,
    REPLAYS,
    WaitReady,
    relay,
    replay,
    resend,
    runtime_gone,
)
from appliance.proxy.share.fair import Fair
from appliance.proxy.share.limits import Limits
from appliance.proxy.waiting import HoldTimeout
from appliance.usage import Ledger, Use

# Answered by the door itself: whether this box's own runtimes serve (peers' front doors ask it)
READINESS_PATH = "/health/readiness"
# Whether this box's own runtimes serve (one is healthy and not held by a switch).
Readiness = Callable[[], Awaitable[bool]]


class Door(Gate):
    """The ASGI layer: the chain of checks (appliance.proxy.chain), then the runtime or
    LiteLLM's app."""

    def __init__(
        self,
        app: ASGIApp,
        backend: Backend | None,
        models: Callable[[], Collection[str] | None],
        key: Callable[[], str] = lambda: os.environ.get("LITELLM_MASTER_KEY", ""),
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        wait_ready: WaitReady | None = None,
        hold_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        hold: Hold | None = None,
        direct_to: Direct | None = None,
        answer_layers: Callable[[ASGIApp], ASGIApp] = lambda app: app,
        backend_of: Callable[[str], Backend | None] | None = None,
        replicas: direct.Replicas | None = None,
        readiness: Readiness | None = None,
        pass_through: bool = True,
        runtimes_of: models.RuntimesOf | None = None,
        keys: KeyRing | None = None,
        limits: Limits | None = None,
        ledger: Ledger | None = None,
        fair: Fair | None = None,
        hold_now: HoldNow | None = None,
        in_clear: Callable[[Scope], Refusal | None] | None = None,
        fleet_usage: Callable[[str, Use], None] | None = None,
    ) -> None:
        self.app = app
        self.fleet_usage = fleet_usage  # each key's use, added to the fleet's (share/fleet.py)
        self.in_clear = in_clear  # with TLS on, a request in clear from afar (proxy/share/tls.py)
        self.backend = backend
        # The runtime that serves a model name, where runtimes serve side by side (else backend)
        self.backend_of = backend_of
        self.replicas = replicas  # names served by several replicas: the router picks one
        self.readiness = readiness
        self.models = models
        self.keys = keys if keys is not None else KeyRing(None, key)
        self.limits = limits  # the limits of people's keys (None: none are kept)
        self.ledger = ledger  # where each key's use is written (None: nowhere)
        self.fair = fair  # fair turns when the runtime is full (None: as they come, [proxy] fair)
        self.max_body_bytes = max_body_bytes
        self.wait_ready = wait_ready
        self.hold_s = hold_s
        self.clock = clock
        self.hold = hold  # the request hold of the fast way; None: every request the full way
        self.hold_now = hold_now  # its first look, which does not leave the request's task
        self.direct_to = direct_to  # None: the fast way is LiteLLM's pass-through route
        # False: chat and completions go the full way ([proxy] pass_through = false)
        self.pass_through = pass_through
        self.runtimes_of = runtimes_of  # the runtimes of a name and their APIs, for /v1/models
        # LiteLLM's layers that shape an answer's headers (CORS, security), around the direct way
        self.direct_app = answer_layers(direct.Call.endpoint)

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await _refuse_websocket(scope, receive, send)
            return
        asks_ready = route_path(scope) == READINESS_PATH and scope["method"] == "GET"
        if self.readiness is not None and asks_ready:
            await self.ready(send)
            return
        SHAPE.set(apis.shape_of(route_path(scope)))  # this request's task alone
        request = Request(scope, receive, send, self.clock())
        try:
            refusal = await self.through(request)
            if refusal is not None:
                await refusal.send(request.meter or send)
            elif request.checked is None:
                await self.app(scope, receive, self.models_answer(scope, send))
            else:
                await self.forward(request)
        except Disconnected:
            pass  # the client left while its request was read or waited: nothing to answer
        finally:
            request.end()

    async def forward(self, request: Request) -> None:
        """A request that passed the chain: the fast way (appliance.proxy.direct or
        appliance.proxy.relay), or the full way through LiteLLM's chat or completion route,
        sent again if the runtime died before answering (appliance.proxy.relay.resend)."""
        checked, meter, scope = request.checked, request.meter, request.scope
        assert checked is not None and meter is not None
        sent = await self.fast(request, meter)
        if sent is not None:
            await resend(self.app, scope, checked.body, request.receive, meter, request.arrived,
                         self.hold_s, self.wait_ready, self.clock, request.token,
                         sent)  # fmt: skip

    async def fast(self, request: Request, send: Send) -> int | None:
        """The request sent the fast way: straight to the runtime when the model has one
        deployment (appliance.proxy.direct), to the replica the router picks when it has
        several, else LiteLLM's pass-through route (appliance.proxy.relay). None when it was
        answered; else it must go the full way, and the number of times it was sent to this
        runtime already (each counts toward relay.REPLAYS: a request that kills its runtime is
        not sent again and again)."""
        checked = request.checked
        assert checked is not None
        scope, receive, token = request.scope, request.receive, request.token
        if checked.kind in apis.BY_KIND:
            await self.to_runtime(request, send)
            return None
        if not self.pass_through or self.hold is None or checked.kind not in PASS_THROUGH:
            return 0
        target = self.direct_to(checked.model) if self.direct_to is not None else None
        if target is None and self.replicas is not None:
            try:
                answered = await self.to_replica(scope, checked, checked.kind, receive, send, token)
            except HoldTimeout as e:
                await hold_timeout(e).send(send)
                return None
            if answered is not None:
                return None if answered else 1
        if not request.held:  # the router had the name, and has it no more: the door's hold
            try:
                await self.held_until_free(token, receive)
            except HoldTimeout as e:
                await hold_timeout(e).send(send)
                return None
        if target is not None:
            call = direct.Call(
                target, checked.kind, direct.as_served(checked.body, checked.model, target)
            )
            await self.direct_app({**scope, call.SCOPE_KEY: call}, receive, send)
            if call.way == direct.ANSWERED:
                return None
            if call.way == direct.NOT_READY and self.wait_ready is not None:
                # The runtime stopped serving: held, like a request that finds it down; if it
                # does not serve again within the request's hold time, that is the answer.
                left = max(0.0, self.hold_s - (self.clock() - request.arrived))
                try:
                    await self.held(self.wait_ready(left, token), call, receive)
                except HoldTimeout as e:
                    await hold_timeout(e).send(send)
                    return None
        elif await relay(self.app, scope, checked.kind, replay(checked.body, receive), send):
            return None
        log(f"b70: {route_path(scope)}: no answer the fast way; sent again the full way")
        return 1

    async def to_runtime(self, request: Request, send: Send) -> None:
        """A request to one of appliance.proxy.apis' routes: straight to the runtime that serves
        its model (or the replica the router picks), sent again when the runtime went away
        before its first byte (at most relay.REPLAYS times more, within the hold time, held
        again each time), and the runtime's error answered in the API's shape. These routes
        have no full way through LiteLLM: both engines serve each of these APIs themselves."""
        checked, arrived = request.checked, request.arrived
        assert checked is not None
        scope, receive, token = request.scope, request.receive, request.token
        for attempt in range(REPLAYS + 1):
            try:
                again = attempt > 0 or not request.held
                target, replica = await self.api_target(checked.model, token, receive, again)
            except HoldTimeout as e:
                await hold_timeout(e).send(send)
                return
            if target is None:
                await not_served(checked.kind, None, "no runtime of this appliance serves the "
                                 "model on this route").send(send)  # fmt: skip
                return
            body = direct.as_served(checked.body, checked.model, target)
            mend = streams.mend_for(checked.kind, checked.streams, checked.model)
            call = direct.Call(target, checked.kind, body, mend=mend)
            await self.direct_app({**scope, call.SCOPE_KEY: call}, receive, send)
            if call.way == direct.ANSWERED:
                return
            if call.way == direct.REFUSED and call.error is not None:
                engine = await _engine_now(checked)
                await runtime_error(checked.kind, *call.error, engine).send(send)
                return
            if replica and self.replicas is not None:
                self.replicas.refused(target)
            left = self.hold_s - (self.clock() - arrived)
            if self.wait_ready is None or left <= 0 or attempt == REPLAYS:
                break
            try:
                waited = await self.held(self.wait_ready(left, token), call, receive)
            except HoldTimeout:
                break
            log(f"b70: {route_path(scope)}: the runtime went away before answering; sent "
                f"again after {waited:.1f} s (attempt {attempt + 2} of {REPLAYS + 1})")  # fmt: skip
        await runtime_gone(self.clock() - arrived, self.hold_s).send(send)

    async def api_target(
        self, model: str, token: str | None, receive: Receive, hold: bool
    ) -> tuple[direct.Target | None, bool]:
        """Where a request for `model` goes (once the hold lets it through, if `hold`), and
        whether it is one of several replicas (the router's pick, which holds it)."""
        target = self.direct_to(model) if self.direct_to is not None else None
        if target is None and self.replicas is not None:
            return await self.replicas.choose(model, token), True
        if hold and self.hold is not None:
            await self.held_until_free(token, receive)
        return target, False

    @staticmethod
    async def held(wait: Awaitable[float], call: direct.Call, receive: Receive) -> float:
        """A request held after its call found no runtime listening (a runtime that does not
        serve, as on demand): given up if its client leaves meanwhile (`unless_left`). One whose
        runtime went away under it waits as it did before."""
        return await (wait if call.reached else unless_left(wait, receive))

    def models_answer(self, scope: Scope, send: Send) -> Send:
        """LiteLLM's answer to the model list (or one model), with the APIs each name speaks
        (appliance.proxy.apis.models); any other answer as it is."""
        path = route_path(scope)
        listing = path in ("/models", "/v1/models") or path.startswith(MODEL_PREFIXES)
        if self.runtimes_of is None or scope["method"] != "GET" or not listing:
            return send
        return models.ModelsAnswer(send, self.runtimes_of, self.engine_of)

    async def engine_of(self, model: str) -> str | None:
        """The engine of the runtime that serves `model` now, asked again unless the door's
        answer is a second old (a switch may have changed it); None when it cannot say."""
        backend = self.backend_of(model) if self.backend_of is not None else self.backend
        facts = await backend.facts(fresh=True) if backend is not None else None
        return facts.engine if facts is not None else None

    async def ready(self, send: Send) -> None:
        """200 when this box's own runtimes serve a name, 503 while none does (switching, or
        down). No key, like the liveness probe, so it names no model."""
        assert self.readiness is not None
        ok = await self.readiness()
        body = json.dumps({"status": "ready" if ok else "not ready"}).encode()
        headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": 200 if ok else 503,
                    "headers": headers})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def to_replica(
        self, scope: Scope, checked: Checked, kind: str, receive: Receive, send: Send,
        token: str | None,
    ) -> bool | None:  # fmt: skip
        """A name served by several replicas: sent to the one LiteLLM's router picks, and to
        another if that one refuses before its first byte. True: answered; False: it goes the
        full way; None: the name is not such a set."""
        assert self.replicas is not None
        for _ in range(direct.MAX_REPLICA_TRIES):
            target = await self.replicas.choose(checked.model, token)
            if target is None:
                return None
            call = direct.Call(target, kind, direct.as_served(checked.body, checked.model, target))
            await self.direct_app({**scope, call.SCOPE_KEY: call}, receive, send)
            if call.way == direct.ANSWERED:
                return True
            if call.way == direct.FULL_WAY:
                return False
            self.replicas.refused(target)
        return False


async def _engine_now(checked: Checked) -> str | None:
    """The engine of the runtime that serves the request's model, asked again unless the door's
    answer is a second old (a switch may have changed it), to name it in an error."""
    facts = await checked.backend.facts(fresh=True) if checked.backend is not None else None
    return facts.engine if facts is not None else None


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """No websocket route exists here: 404 where the server can say so, else a close."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        refusal = Refusal(
            404, f"there is no route {route_path(scope)} on this appliance", "not_found"
        )
        body = refusal.body()
        start = {"type": "websocket.http.response.start", "status": 404}
        start["headers"] = [(b"content-type", b"application/json")]
        await send(start)
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": 1008})
