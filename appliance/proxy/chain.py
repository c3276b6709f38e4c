"""A request's way through the door (appliance.proxy.door): one ordered list of checks, CHAIN.

Each check is given the request (`Request`: what the door knows of it so far) and returns a
Refusal, which is the answer, or None: the next check. In order:

1. clear: with TLS on, a request in clear HTTP from another machine (its key crossed the
   network in clear) is refused (appliance.proxy.share.tls.InClear).
2. route: only ROUTES exist: chat completions, completions and models (with and without `/v1`;
   GET /v1/models/{name} for the names served), the liveness and readiness probes, and the APIs
   of appliance.proxy.apis (Responses, Anthropic Messages, embeddings, rerank, tokenize). Every
   other path LiteLLM registers (admin, UI, docs, spend, keys, model management, config, debug,
   pass-through, MCP, websockets, ...) answers 404 to everyone, key or not; an allowed path
   asked with another method answers 405. The probes and OPTIONS go no further: LiteLLM's app
   answers them.
3. key: `Authorization: Bearer KEY` or `x-api-key: KEY`, the master key or one `b70ctl keys`
   made (401 otherwise), before any of the body is read. The model list goes no further.
4. size: a body sent as a form is refused (415: LiteLLM would read a form, not the JSON checked
   here); a body over `max_body_bytes` ([proxy] max_body_mib, default 8 MiB) is refused with
   413, at once from its Content-Length, or as soon as a chunked body passes it, so no more
   than the limit is ever held. 8 MiB holds a whole 131072-token context as text many times
   over (about 4 bytes a token, up to 6 in JSON escapes) and a few images as data URLs.
5. shape: the request alone, as its API says it must be: JSON, an object, a `model` served
   here (404), and the fields of its API (chat's messages, a completion's prompt, max_tokens;
   appliance.proxy.checks, appliance.proxy.apis.checks).
6. API: the request against what the serving runtime's API says: max_tokens and the prompt
   against its context, asked again before a refusal (appliance.proxy.checks.against_facts).
7. limits: the key's requests at once, a minute and tokens a minute (429 with Retry-After,
   counted as limited). From here the request counts: in its key's usage when it ends, and in
   the hold's ticket that a switch and the demand see.
8. turns: when the runtime runs all it can, the request waits its turn in fair order
   (appliance.proxy.share.fair); 503 when the hold's time runs out first.
9. hold: while a switch holds the runtime, or it is down, the request waits for it (503 when
   the hold's time runs out). A request for a name that several replicas serve is held by the
   router's pick instead, and one that goes LiteLLM's full way by the hook
   (appliance.proxy.hook).

Then the door forwards it (appliance.proxy.door). A client that leaves while its body is read or
while it waits (turns, hold) is not answered, and its place is freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from appliance import hold
from appliance.people import MASTER_KEY, KeyRing, Person
from appliance.proxy import Receive, Send, apis, direct
from appliance.proxy.apis.checks import check_api, judge_api, with_both_words
from appliance.proxy.backend import CHAT, COMPLETION, Backend, Facts
from appliance.proxy.checks import Refusal, against_facts, check_shape, judge, parse_body
from appliance.proxy.relay import PASS_THROUGH
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
DEFAULT_MAX_BODY_BYTES = 8 * MIB
BYPASS_HEADER = hold.BYPASS_HEADER.encode()
PEER_HEADER = hold.PEER_HEADER.encode()
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
NO_KEY = (
    "no API key: send your key (`b70ctl keys add NAME` makes one) or the appliance's master key "
    "(LITELLM_MASTER_KEY in its proxy.env) as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
)
WRONG_KEY = (
    "the API key is not the appliance's key, nor one that `b70ctl keys` made and did not revoke"
)


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


@dataclass
class Request:
    """One request on its way through the chain: what the checks found so far."""

    scope: Scope
    receive: Receive
    send: Send
    arrived: float  # the door's clock when it came
    kind: str = ""  # its route's kind (CHAT, COMPLETION, MODELS, PROBE, an API's)
    done: bool = False  # the chain ends here, and LiteLLM's app answers (probes, the model list)
    person: Person = MASTER_KEY
    data: dict[str, Any] = field(default_factory=dict)
    size: int = 0  # the bytes of its body, as it came
    checked: Checked | None = None
    token: str | None = None  # its hold token: a switch's own request
    from_peer: bool = False  # a peer's front door sent it
    ticket: hold.Ticket | None = None
    meter: Meter | None = None  # the answer's way back, counting its tokens
    turn: Turn | None = None
    held: bool = False  # the door's hold let it through (check_hold)
    endings: list[Callable[[], None]] = field(default_factory=list)  # run when it ends

    @property
    def path(self) -> str:
        return route_path(self.scope)

    def end(self) -> None:
        """What the checks took, given back: the last taken first."""
        while self.endings:
            self.endings.pop()()


class Gate:
    """The door's checks, and what they read (set by appliance.proxy.door.Door)."""

    app: Any
    in_clear: Callable[[Scope], Refusal | None] | None
    models: Callable[[], Collection[str] | None]
    keys: KeyRing
    max_body_bytes: int
    backend: Backend | None
    backend_of: Callable[[str], Backend | None] | None
    limits: Limits | None
    ledger: Ledger | None
    fleet_usage: Callable[[str, Use], None] | None
    fair: Fair | None
    hold: Hold | None
    hold_now: HoldNow | None
    hold_s: float
    clock: Callable[[], float]
    direct_to: Direct | None
    replicas: direct.Replicas | None
    pass_through: bool

    async def through(self, request: Request) -> Refusal | None:
        """The request through CHAIN: the first refusal, or None (it goes on)."""
        for check in CHAIN:
            refusal = await check(self, request)
            if refusal is not None or request.done:
                return refusal
        return None

    async def check_clear(self, request: Request) -> Refusal | None:
        return self.in_clear(request.scope) if self.in_clear is not None else None

    async def check_route(self, request: Request) -> Refusal | None:
        path, method = request.path, str(request.scope["method"])
        route = route_of(path, self.models())
        if route is None:
            return Refusal(404, f"there is no route {path} on this appliance", "not_found")
        request.kind, methods = route
        if method not in methods:
            allow = ", ".join(sorted(methods))
            return Refusal(
                405, f"{path} takes {allow}, not {method}", "method_not_allowed",
                headers={"Allow": allow},
            )  # fmt: skip
        request.done = request.kind == PROBE or method == "OPTIONS"
        return None

    async def check_key(self, request: Request) -> Refusal | None:
        scope = request.scope
        try:
            person = whose_key(
                self.keys, header(scope, b"authorization"), header(scope, b"x-api-key")
            )
        except Refusal as refusal:  # the 401 that says what is wrong with the key
            return refusal
        request.person = person
        request.done = request.kind == MODELS
        if person is MASTER_KEY:  # a switch's own requests, and a peer's, come with it
            request.token = header(request.scope, BYPASS_HEADER)
            request.from_peer = header(request.scope, PEER_HEADER) is not None
        return None

    async def check_size(self, request: Request) -> Refusal | None:
        scope = request.scope
        media_type = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if media_type in FORM_TYPES:
            return Refusal(
                415, f"the request body must be JSON, sent as Content-Type: application/json, "
                f"not {media_type}", "unsupported_media_type",
            )  # fmt: skip
        limit = self.max_body_bytes
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return too_large(int(declared), limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_large(None, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        request.size = len(body)
        request.checked = Checked(body, "", request.kind, person=request.person)
        return None

    async def check_shape(self, request: Request) -> Refusal | None:
        assert request.checked is not None
        data = parse_body(request.checked.body)
        if isinstance(data, Refusal):
            return data
        kind, models = request.kind, self.models()
        refusal = check_api(kind, data, models) if kind in apis.BY_KIND else None
        if kind not in apis.BY_KIND:
            refusal = check_shape(kind, data, models)
        if refusal is not None:
            return refusal
        request.data = data
        backend = self.backend
        if self.backend_of is not None and isinstance(data.get("model"), str):
            backend = self.backend_of(data["model"])
        body = request.checked.body
        body = with_both_words(body, data) if kind == apis.TOKENIZE else body
        asked = [data.get(k) for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")]
        tokens = next((n for n in asked if isinstance(n, int) and not isinstance(n, bool)), 0)
        strip = kind in (CHAT, COMPLETION) and ask_usage(data)  # the key's tokens, when it streams
        if strip:
            body = json.dumps(data, ensure_ascii=False).encode()
        request.checked = Checked(
            body, data["model"], kind, backend, data.get("stream") is True, tokens,
            request.person, strip,
        )  # fmt: skip
        return None

    async def check_api(self, request: Request) -> Refusal | None:
        checked, data = request.checked, request.data
        assert checked is not None
        if checked.backend is None:
            return None
        backend, kind, size = checked.backend, checked.kind, request.size

        async def judged(facts: Facts) -> Refusal | None:
            if kind in apis.BY_KIND:
                return judge_api(kind, data, facts)
            return await judge(kind, data, size, facts, backend)

        return await against_facts(backend, judged)

    async def check_limits(self, request: Request) -> Refusal | None:
        checked, person = request.checked, request.person
        assert checked is not None
        if self.limits is not None:
            try:
                await self.limits.admit_async(person)
            except Refusal as refusal:
                self.count(person, Use(limited=1))
                return refusal
        # opened by the turnstile of the model's runtime when it lets the request through
        ticket = hold.Ticket(checked.model, request.token, request.from_peer)
        ticket.tokens = max(0, checked.tokens)
        context = hold.TICKET.set(ticket)
        meter = Meter(request.send, strip=checked.strip_usage)
        request.ticket, request.meter = ticket, meter

        def ended() -> None:
            ticket.close()
            hold.TICKET.reset(context)
            if self.limits is not None:
                self.limits.done(person, meter.tokens_in + meter.tokens_out)
            use = Use(1, meter.tokens_in, meter.tokens_out, ticket.queued_s)
            self.count(person, use, request.from_peer)

        request.endings.append(ended)
        return None

    async def check_turns(self, request: Request) -> Refusal | None:
        """The request's turn among those the runtime runs: at once while it has room, else
        after those before it in fair order; the hold's time counts, and a client that leaves
        frees its place. Not a switch's own request (its hold token), nor one for a name with
        several deployments (replicas, peers), which the router spreads."""
        checked, ticket = request.checked, request.ticket
        assert checked is not None and ticket is not None
        if self.fair is None or request.token is not None:
            return None
        if self.direct_to is not None and self.direct_to(checked.model) is None:
            return None
        got = self.fair.enter_now(request.person, checked.backend,
                                  cost_of(len(checked.body), checked.tokens))  # fmt: skip
        if isinstance(got, Waiting):
            limit = self.hold_s - (self.clock() - request.arrived) if self.hold_s > 0 else None
            started = self.clock()
            try:
                got = await unless_left(got.turn(limit), request.receive)
            except HoldTimeout as e:
                return hold_timeout(e)
            finally:
                ticket.queued_s += self.clock() - started
        if got is not None:
            request.turn = got
            request.endings.append(lambda: Fair.leave(got))
        return None

    async def check_hold(self, request: Request) -> Refusal | None:
        if not self.held_here(request):
            return None
        try:
            await self.held_until_free(request.token, request.receive)
        except HoldTimeout as e:
            return hold_timeout(e)
        request.held = True
        return None

    def held_here(self, request: Request) -> bool:
        """Whether the door holds the request itself: not one that goes LiteLLM's full way
        (the hook holds it), nor one for a set of replicas (the router's pick holds it)."""
        checked = request.checked
        assert checked is not None
        if self.hold is None:
            return False
        full_way = not self.pass_through or checked.kind not in PASS_THROUGH
        if checked.kind not in apis.BY_KIND and full_way:
            return False
        one = self.direct_to(checked.model) if self.direct_to is not None else None
        return one is not None or self.replicas is None or not self.replicas.serves(checked.model)

    async def held_until_free(self, token: str | None, receive: Receive) -> None:
        """The hold: its first look in this step of the request's task (a request that is not
        held is written to the runtime in the same step as the door's checks); a request that
        must wait is given up if its client leaves meanwhile."""
        if self.hold_now is not None and self.hold_now(token):
            return
        assert self.hold is not None
        await unless_left(self.hold(token), receive)

    def count(self, person: Person, use: Use, from_peer: bool = False) -> None:
        """A request's use, in its key's usage (and the fleet's, unless a peer sent it: the
        door that took it from the client counts it there)."""
        if self.ledger is not None:
            self.ledger.add(person.name, use)
        if self.fleet_usage is not None and not from_peer:
            self.fleet_usage(person.name, use)


Check = Callable[[Gate, Request], Awaitable[Refusal | None]]
# The order of the door's checks, the one place that states it.
CHAIN: tuple[Check, ...] = (
    Gate.check_clear,
    Gate.check_route,
    Gate.check_key,
    Gate.check_size,
    Gate.check_shape,
    Gate.check_api,
    Gate.check_limits,
    Gate.check_turns,
    Gate.check_hold,
)


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


def route_path(scope: Scope) -> str:
    """The path the app routes on (Starlette's rule: the path less the root path)."""
    path, root = str(scope["path"]), str(scope.get("root_path") or "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def given_key(authorization: str | None, api_key: str | None = None) -> str:
    """The key an `Authorization` header carries (or an `x-api-key` header, as Anthropic's
    clients send it)."""
    return (authorization or "").removeprefix("Bearer ").strip() or (api_key or "").strip()


def whose_key(keys: KeyRing, authorization: str | None, api_key: str | None = None) -> Person:
    """The key's holder (people.MASTER_KEY for the master key), or the 401 that says what is
    wrong with it."""
    given = given_key(authorization, api_key)
    person = keys.who(given) if given else None
    if person is None:
        raise unauthorized(WRONG_KEY if given else NO_KEY)
    return person


def unauthorized(message: str) -> Refusal:
    return Refusal(
        401, message, "invalid_api_key", kind="authentication_error",
        headers={"WWW-Authenticate": "Bearer"},
    )  # fmt: skip


def hold_timeout(e: HoldTimeout) -> Refusal:
    """The answer to a request whose hold time ran out (as the hook answers it on the full way)."""
    return Refusal(
        503, f"the model is not available: {e.why}; this request waited {e.waited_s:.0f} s. "
        f"Retry after {e.retry_after_s} s.", "b70_hold_timeout", kind="service_unavailable",
        headers={"Retry-After": str(e.retry_after_s)},
    )  # fmt: skip


def too_large(declared: int | None, limit: int) -> Refusal:
    size = f"{declared} bytes, more than" if declared is not None else "more than"
    return Refusal(
        413, f"the request body is {size} the {limit} bytes ({limit / MIB:g} MiB) this appliance "
        "takes; the limit is [proxy] max_body_mib", "request_too_large",
    )  # fmt: skip


async def unless_left(wait: Awaitable[T], receive: Receive) -> T:
    """A wait (the hold's, a turn's), given up when the client leaves meanwhile (Disconnected):
    its place among the requests waiting is freed at once, not when the hold time runs out (the
    switch on demand counts those places). The body was read: the client's next message says
    it left."""
    waiting = asyncio.ensure_future(wait)
    watch = asyncio.ensure_future(receive())
    try:
        await asyncio.wait((waiting, watch), return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            return waiting.result()  # or its HoldTimeout
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        raise Disconnected
    finally:
        watch.cancel()
        waiting.cancel()


class Disconnected(Exception):
    """The client left while its body was read or while it waited: nothing to answer."""
