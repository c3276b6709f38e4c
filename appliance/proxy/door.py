"""The door of the appliance: an ASGI layer in front of LiteLLM's app, in every proxy worker.

Port 8000 serves only the appliance's own routes, and checks every request to the model before
LiteLLM parses it, so a bad request costs the runtime nothing. In order:

1. The route. Only ROUTES exist: chat completions, completions and models (with and without
   `/v1`; GET /v1/models/{name} for the names served), the liveness and readiness probes, and
   the APIs of appliance.proxy.apis (Responses, Anthropic Messages, embeddings, rerank,
   tokenize), each straight to the runtime's own route (`to_runtime`).
   Every other path LiteLLM registers (admin, UI, docs, openapi, spend, keys, model management,
   config, debug, pass-through, MCP, websockets, ...) answers 404 to everyone, key or not; an
   allowed path asked with another method answers 405.
2. The key: every route but the probes needs `Authorization: Bearer <the appliance's key>`
   or `x-api-key: <the key>` (401 otherwise), before any of the request body is read. A body
   sent as a form (curl -d without a Content-Type) is refused (415): LiteLLM would read it as a
   form, not as JSON.
3. The body of every request to the model, on every API: at most `max_body_bytes`
   ([proxy] max_body_mib, B70_MAX_BODY_BYTES in the proxy's environment, default 8 MiB). A
   Content-Length over it is refused at once with 413, before the body is sent; a chunked body
   is counted as it arrives and refused as soon as it passes the limit, so no more than the
   limit is ever held. 8 MiB
   holds a whole 131072-token context as text many times over (about 4 bytes a token, up to 6
   in JSON escapes) and a few images as data URLs; bodies of tens of megabytes, which would keep
   the proxy and the runtime busy parsing them, do not pass.
4-6. The request itself: JSON, model, messages or prompt, max_tokens, the prompt against the
   runtime's context (appliance.proxy.checks).

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

Imported by the proxy: nothing from the rest of the controller but appliance.proxy.checks and
appliance.hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, NamedTuple, TypeVar

from appliance import hold
from appliance.people import MASTER_KEY, KeyRing, Person
from appliance.proxy import apis, direct
from appliance.proxy.apis import models, streams
from appliance.proxy.apis.answers import not_served, runtime_error
from appliance.proxy.apis.checks import check_api_request, with_both_words
from appliance.proxy.asgi import ASGIApp, Receive, Send, log
from appliance.proxy.backend import CHAT, COMPLETION, Backend
from appliance.proxy.checks import SHAPE, Refusal, check_request, parse_body
from appliance.proxy.relay import (
    PASS_THROUGH,
    REPLAYS,
    WaitReady,
    relay,
    replay,
    resend,
    runtime_gone,
)
from appliance.proxy.share.fair import Fair, Turn, Waiting
from appliance.proxy.share.limits import Limits
from appliance.proxy.share.meter import Meter, ask_usage
from appliance.proxy.share.turns import cost_of
from appliance.proxy.waiting import HoldTimeout
from appliance.usage import Ledger, Use

Scope = Mapping[str, Any]
T = TypeVar("T")
# Holds a request while the runtime cannot take it (raises HoldTimeout when the hold time runs
# out). The token is the request's hold token (a switch's own request passes the switch's hold).
Hold = Callable[[str | None], Awaitable[float]]
# The hold's first look, which does not leave the request's task: True when it may go on now.
HoldNow = Callable[[str | None], bool]
# Where a model name's one deployment is served, when the door may send it there itself.
Direct = Callable[[str], direct.Target | None]


MIB = 1024 * 1024
BYPASS_HEADER = hold.BYPASS_HEADER.encode()
DEFAULT_MAX_BODY_BYTES = 8 * MIB

MODELS, PROBE = "models", "probe"
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
ROUTES: dict[str, tuple[str, frozenset[str]]] = {
    path: (kind, frozenset(methods))
    for prefix in ("", "/v1")
    for path, kind, methods in (
        (f"{prefix}/chat/completions", CHAT, ("POST", "OPTIONS")),
        (f"{prefix}/completions", COMPLETION, ("POST", "OPTIONS")),
        (f"{prefix}/models", MODELS, ("GET", "OPTIONS")),
    )
}
ROUTES |= {
    path: (PROBE, frozenset(("GET", "OPTIONS")))
    for path in ("/health/liveliness", "/health/liveness", "/health/readiness")
}
ROUTES |= {
    path: (route.kind, frozenset(("POST", "OPTIONS"))) for path, route in apis.BY_PATH.items()
}
MODEL_PREFIXES = ("/models/", "/v1/models/")  # GET /v1/models/{model}, a model served here
# Answered by the door itself: whether this box's own runtimes serve (peers' front doors ask it)
READINESS_PATH = "/health/readiness"
PEER_HEADER = hold.PEER_HEADER.encode()
# Whether this box's own runtimes serve (one is healthy and not held by a switch).
Readiness = Callable[[], Awaitable[bool]]


def route_of(path: str, models: Collection[str] | None) -> tuple[str, frozenset[str]] | None:
    """The kind and methods of an allowed path, or None: that path does not exist here.
    `models`: the names served, or None when not known yet (then any one path segment)."""
    if path in ROUTES:
        return ROUTES[path]
    for prefix in MODEL_PREFIXES:
        name = path.removeprefix(prefix)
        if name != path and (name in models if models is not None else name and "/" not in name):
            return MODELS, frozenset(("GET", "OPTIONS"))
    return None


# --- the key --------------------------------------------------------------------------------------


NO_KEY = (
    "no API key: send your key (`b70ctl keys add NAME` makes one) or the appliance's master key "
    "(LITELLM_MASTER_KEY in its proxy.env) as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
)
WRONG_KEY = (
    "the API key is not the appliance's key, nor one that `b70ctl keys` made and did not revoke"
)


def given_key(authorization: str | None, api_key: str | None = None) -> str:
    """The key an `Authorization` header carries (or an `x-api-key` header, as Anthropic's
    clients send it)."""
    return (authorization or "").removeprefix("Bearer ").strip() or (api_key or "").strip()


def whose_key(keys: KeyRing, authorization: str | None, api_key: str | None = None) -> Person:
    """The key's holder (people.MASTER_KEY for the master key), or the 401 that says what is
    wrong with it."""
    given = given_key(authorization, api_key)
    if not given:
        raise unauthorized(NO_KEY)
    person = keys.who(given)
    if person is None:
        raise unauthorized(WRONG_KEY)
    return person


def hold_timeout(e: HoldTimeout) -> Refusal:
    """The answer to a request whose hold time ran out (as the hook answers it on the full way)."""
    return Refusal(
        503, f"the model is not available: {e.why}; this request waited {e.waited_s:.0f} s. "
        f"Retry after {e.retry_after_s} s.", "b70_hold_timeout", kind="service_unavailable",
        headers={"Retry-After": str(e.retry_after_s)},
    )  # fmt: skip


def unauthorized(message: str) -> Refusal:
    return Refusal(
        401, message, "invalid_api_key", kind="authentication_error",
        headers={"WWW-Authenticate": "Bearer"},
    )  # fmt: skip


# --- the layer ------------------------------------------------------------------------------------


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def route_path(scope: Scope) -> str:
    """The path the app routes on (Starlette's rule: the path less the root path)."""
    path, root = str(scope["path"]), str(scope.get("root_path") or "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


class Door:
    """The ASGI layer: routes, key, body and request checks, then LiteLLM's app."""

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
        arrived = self.clock()
        SHAPE.set(apis.shape_of(route_path(scope)))  # this request's task alone
        if self.in_clear is not None and (refusal := self.in_clear(scope)) is not None:
            await refusal.send(send)
            return
        try:
            checked = await self.check(scope, receive)
        except Refusal as refusal:
            # Its traceback holds the frames that hold the request (megabytes, maybe): let them
            # go now rather than at the next collection of reference cycles.
            refusal.__traceback__ = None
            await refusal.send(send)
            return
        except _Disconnected:
            return
        if checked is None:
            await self.app(scope, receive, self.models_answer(scope, send))
        else:
            await self.forward(scope, checked, receive, send, arrived)

    async def forward(
        self, scope: Scope, checked: Checked, receive: Receive, send: Send, arrived: float
    ) -> None:
        """A request to the model: held while the runtime cannot take it, then the fast way
        (appliance.proxy.direct or appliance.proxy.relay), or the full way through LiteLLM's
        chat or completion route, sent again if the runtime died before answering
        (appliance.proxy.relay.resend)."""
        person = checked.person
        master = person is MASTER_KEY
        # The request's hold token, if it sent one; a switch's own requests come with the master
        # key, as do a peer's (a person's key does not pass the hold, nor speak for a peer).
        token = _header(scope, BYPASS_HEADER) if master else None
        from_peer = master and _header(scope, PEER_HEADER) is not None
        if self.limits is not None:
            try:
                await self.limits.admit_async(person)
            except Refusal as refusal:
                self.count(person, Use(limited=1))
                await refusal.send(send)
                return
        # opened by the turnstile of the model's runtime when it lets the request through
        ticket = hold.Ticket(checked.model, token, from_peer)
        ticket.tokens = max(0, checked.tokens)
        context = hold.TICKET.set(ticket)
        meter = Meter(send, strip=checked.strip_usage)
        turn: Turn | None = None
        try:
            if self.takes_turns(checked, token):
                taken = await self.take_turn(checked, receive, arrived, ticket)
                if isinstance(taken, Refusal):
                    await taken.send(meter)
                    return
                turn = taken
            sent = await self.fast(scope, checked, receive, meter, token, arrived)
            if sent is not None:
                await resend(self.app, scope, checked.body, receive, meter, arrived, self.hold_s,
                             self.wait_ready, self.clock, token, sent)  # fmt: skip
        except _Disconnected:
            pass  # the client left while its request waited: nothing to answer
        finally:
            Fair.leave(turn)
            ticket.close()
            hold.TICKET.reset(context)
            tokens = meter.tokens_in + meter.tokens_out
            if self.limits is not None:
                self.limits.done(person, tokens)
            use = Use(1, meter.tokens_in, meter.tokens_out, ticket.queued_s)
            self.count(person, use, from_peer)

    def takes_turns(self, checked: Checked, token: str | None) -> bool:
        """Whether the request waits its turn when the runtime is full: not a switch's own
        (its hold token), nor one for a name with several deployments (replicas on several
        cards, peers), which the router spreads."""
        if self.fair is None or token is not None:
            return False
        return self.direct_to is None or self.direct_to(checked.model) is not None

    async def take_turn(
        self, checked: Checked, receive: Receive, arrived: float, ticket: hold.Ticket
    ) -> Turn | Refusal | None:
        """The request's turn among those the runtime runs (appliance.proxy.share.fair): at
        once while it has room, else after those before it in fair order; the hold's time
        counts, and a client that leaves frees its place."""
        assert self.fair is not None
        cost = cost_of(len(checked.body), checked.tokens)
        got = self.fair.enter_now(checked.person, checked.backend, cost)
        if not isinstance(got, Waiting):
            return got  # its turn now (or none to take), in this step of its task
        limit = self.hold_s - (self.clock() - arrived) if self.hold_s > 0 else None
        started = self.clock()
        try:
            return await unless_left(got.turn(limit), receive)
        except HoldTimeout as e:
            return hold_timeout(e)
        finally:
            ticket.queued_s += self.clock() - started

    def count(self, person: Person, use: Use, from_peer: bool = False) -> None:
        """A request's use, in its key's usage (and the fleet's, unless a peer sent it: the
        door that took it from the client counts it there)."""
        if self.ledger is not None:
            self.ledger.add(person.name, use)
        if self.fleet_usage is not None and not from_peer:
            self.fleet_usage(person.name, use)

    async def fast(
        self, scope: Scope, checked: Checked, receive: Receive, send: Send, token: str | None,
        arrived: float,
    ) -> int | None:  # fmt: skip
        """The request held, then sent the fast way: straight to the runtime when the model
        has one deployment (appliance.proxy.direct), else LiteLLM's pass-through route
        (appliance.proxy.relay). None when it was answered; else it must go the full way, and
        the number of times it was sent to this runtime already (each counts toward
        relay.REPLAYS: a request that kills its runtime is not sent again and again)."""
        if checked.kind in apis.BY_KIND:
            await self.to_runtime(scope, checked, receive, send, token, arrived)
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
                left = max(0.0, self.hold_s - (self.clock() - arrived))
                try:
                    await self.held(self.wait_ready(left, token), call, receive)
                except HoldTimeout as e:
                    await hold_timeout(e).send(send)
                    return None
        elif await relay(self.app, scope, checked.kind, replay(checked.body, receive), send):
            return None
        log(f"b70: {route_path(scope)}: no answer the fast way; sent again the full way")
        return 1

    async def to_runtime(
        self, scope: Scope, checked: Checked, receive: Receive, send: Send, token: str | None,
        arrived: float,
    ) -> None:  # fmt: skip
        """A request to one of appliance.proxy.apis' routes: held, then straight to the runtime
        that serves its model (or the replica the router picks), sent again when the runtime
        went away before its first byte (at most relay.REPLAYS times more, within the hold
        time), and the runtime's error answered in the API's shape. These routes have no full
        way through LiteLLM: both engines serve each of these APIs themselves."""
        for attempt in range(REPLAYS + 1):
            try:
                target, replica = await self.api_target(checked.model, token, receive)
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
        self, model: str, token: str | None, receive: Receive
    ) -> tuple[direct.Target | None, bool]:
        """Where a request for `model` goes, once the hold lets it through, and whether it is
        one of several replicas (the router's pick)."""
        target = self.direct_to(model) if self.direct_to is not None else None
        if target is None and self.replicas is not None:
            return await self.replicas.choose(model, token), True
        if self.hold is not None:
            await self.held_until_free(token, receive)
        return target, False

    async def held_until_free(self, token: str | None, receive: Receive) -> None:
        """The hold of the fast way: its first look in this step of the request's task (a request
        that is not held is written to the runtime in the same step as the door's checks); a
        request that must wait is given up if its client leaves meanwhile."""
        if self.hold_now is not None and self.hold_now(token):
            return
        assert self.hold is not None
        await unless_left(self.hold(token), receive)

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

    async def check(self, scope: Scope, receive: Receive) -> Checked | None:
        """Refuses the request, or gives the body read here (None: no body is read here)."""
        path, method, models = route_path(scope), str(scope["method"]), self.models()
        route = route_of(path, models)
        if route is None:
            raise Refusal(404, f"there is no route {path} on this appliance", "not_found")
        kind, methods = route
        if method not in methods:
            allow = ", ".join(sorted(methods))
            raise Refusal(
                405, f"{path} takes {allow}, not {method}", "method_not_allowed",
                headers={"Allow": allow},
            )  # fmt: skip
        if kind == PROBE or method == "OPTIONS":
            return None
        person = whose_key(
            self.keys, _header(scope, b"authorization"), _header(scope, b"x-api-key")
        )
        if kind == MODELS:
            return None
        media_type = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if media_type in FORM_TYPES:  # LiteLLM would read a form, not the JSON checked here
            raise Refusal(
                415, f"the request body must be JSON, sent as Content-Type: application/json, "
                f"not {media_type}", "unsupported_media_type",
            )  # fmt: skip
        body = await self.read_body(scope, receive)
        data = parse_body(body)
        if isinstance(data, Refusal):
            raise data
        backend = self.backend
        if self.backend_of is not None and isinstance(data.get("model"), str):
            backend = self.backend_of(data["model"])
        if kind in apis.BY_KIND:
            refusal = await check_api_request(kind, data, models, backend)
            body = with_both_words(body, data) if kind == apis.TOKENIZE else body
        else:
            refusal = await check_request(kind, data, len(body), models, backend)
        if refusal is not None:
            raise refusal
        asked = [data.get(k) for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")]
        tokens = next((n for n in asked if isinstance(n, int) and not isinstance(n, bool)), 0)
        strip = kind in (CHAT, COMPLETION) and ask_usage(data)  # the key's tokens, when it streams
        if strip:
            body = json.dumps(data, ensure_ascii=False).encode()
        return Checked(
            body, data["model"], kind, backend, data.get("stream") is True, tokens, person, strip
        )

    async def read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(None, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class Checked(NamedTuple):
    """A request to the model that passed the door's checks."""

    body: bytes
    model: str  # the name it asked for, one the router serves
    kind: str = CHAT
    backend: Backend | None = None  # the runtime that serves the name, as the door sees it
    streams: bool = False
    tokens: int = 0  # the most tokens of an answer it asks for, if it says (the demand's weight)
    person: Person = MASTER_KEY  # whose key it came with
    strip_usage: bool = False  # the door asked for its stream's usage: the usage chunk is its own


async def _engine_now(checked: Checked) -> str | None:
    """The engine of the runtime that serves the request's model, asked again unless the door's
    answer is a second old (a switch may have changed it), to name it in an error."""
    facts = await checked.backend.facts(fresh=True) if checked.backend is not None else None
    return facts.engine if facts is not None else None


async def unless_left(wait: Awaitable[T], receive: Receive) -> T:
    """A hold's wait, given up when the client leaves meanwhile (_Disconnected): its place
    among the requests waiting is freed at once, not when the hold time runs out (the switch on
    demand counts those places). The body was read: the client's next message says it left."""
    waiting = asyncio.ensure_future(wait)
    watch = asyncio.ensure_future(receive())
    try:
        await asyncio.wait((waiting, watch), return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            return waiting.result()  # or its HoldTimeout
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        raise _Disconnected
    finally:
        watch.cancel()
        waiting.cancel()


class _Disconnected(Exception):
    """The client left while its body was being read: nothing to answer."""


def _too_large(declared: int | None, limit: int) -> Refusal:
    size = f"{declared} bytes, more than" if declared is not None else "more than"
    return Refusal(
        413, f"the request body is {size} the {limit} bytes ({limit / MIB:g} MiB) this appliance "
        "takes; the limit is [proxy] max_body_mib", "request_too_large",
    )  # fmt: skip


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
