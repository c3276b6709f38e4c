"""The LiteLLM side of the appliance: the door, the request hold and the API-key check.

Loaded by the proxy through the rendered litellm.yaml:
    litellm_settings: callbacks: ["appliance.proxy.hook.hold"]
    general_settings: custom_auth: appliance.proxy.hook.authenticate

Importing it inside the proxy puts the door (appliance.proxy.door) in front of LiteLLM's app:
only the appliance's routes exist, and bad requests are refused before LiteLLM parses them.

The proxy unit tells this module where things are through its environment:
    B70_STATE_DIR       where `b70ctl switch` writes its hold mark (appliance.proxy.hold)
    B70_BACKEND_URL     the runtimes' addresses, one per runtime port (space-separated); each has
                        its own hold, whose /health is probed
    B70_HOLD_S          how long a request may wait before it is answered 503
    B70_MAX_BODY_BYTES  the largest request body the door takes (default 8 MiB)

A request waits while a switch of its model's runtime is marked or while that runtime is not
healthy, and goes through as soon as neither is true. A backend that is slow to answer /health
is busy, not down: only a refused connection or a non-200 answer holds requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from fastapi import Request
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import LitellmUserRoles, ProxyException, UserAPIKeyAuth

from appliance.proxy import backend as backend_mod
from appliance.proxy import direct, door, mount
from appliance.proxy import hold as hold_mark
from appliance.proxy.waiting import HEALTH_TTL_S, POLL_S, Gate, HoldTimeout, Probe

HEALTH_TIMEOUT_S = 2.0


def health_probe(backend_url: str) -> Probe:
    client: httpx.AsyncClient | None = None

    async def probe() -> bool:
        nonlocal client
        if client is None:  # created inside the proxy's event loop
            client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)
        try:
            response = await client.get(backend_url + "/health")
        except httpx.TimeoutException:
            return True  # alive and busy
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    return probe


def _request_headers(data: Mapping[str, Any]) -> Mapping[str, Any]:
    request = data.get("proxy_server_request") or {}
    headers = request.get("headers") if isinstance(request, dict) else None
    return headers if isinstance(headers, dict) else {}


class HoldHook(CustomLogger):
    def __init__(
        self,
        gate: Gate | None = None,
        backend: backend_mod.Backend | None = None,
        runtimes: mount.Runtimes | None = None,
    ) -> None:
        super().__init__()
        self._gate = gate  # one gate for every request (tests)
        self.backend = backend  # the door's view of the first runtime, to name it in errors
        self.runtimes = runtimes
        self._gates: dict[str, Gate] = {}
        self._peers: dict[str, Peer] = {}

    @property
    def gate(self) -> Gate:
        """The first runtime's gate (the only one, unless runtimes serve side by side)."""
        return self.gate_for(None)

    def gate_for(self, model: str | None) -> Gate:
        """The hold of the runtime that serves `model`."""
        if self._gate is not None:
            return self._gate
        if self.runtimes is not None:
            return self.gate_at(self.runtimes.url_of(model))
        return self.gate_at(os.environ["B70_BACKEND_URL"].split()[0])

    def gate_at(self, url: str) -> Gate:
        gate = self._gates.get(url)
        if gate is None:
            env = os.environ
            gate = self._gates[url] = Gate(
                Path(env["B70_STATE_DIR"]),
                health_probe(url),
                float(env.get("B70_HOLD_S", "300")),
                port=urllib.parse.urlsplit(url).port,
            )
        return gate

    # --- a name served by several replicas, or by peers too: LiteLLM's router picks among
    # those that serve now

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[Any],
        messages: Any,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[Any]:
        """LiteLLM's router leaves out the replicas a switch holds (a switch's own request goes
        only where it holds), peers whose readiness says they do not serve, and peers for a
        request that came from a peer; if that would leave none, it keeps them all, and the
        door waits (choose)."""
        if self.runtimes is None or len(healthy_deployments) < 2:
            return healthy_deployments
        ticket = hold_mark.TICKET.get()
        mark = hold_mark.read_mark(Path(os.environ["B70_STATE_DIR"]))
        kept = [d for d in healthy_deployments if self._admits(d, ticket, mark)]
        return kept or healthy_deployments

    def _admits(
        self, deployment: Any, ticket: hold_mark.Ticket | None, mark: hold_mark.Mark | None
    ) -> bool:
        assert self.runtimes is not None
        found = self.runtimes.where(deployment)
        if found is None:
            return True
        url, is_peer = found
        if is_peer:
            from_peer = ticket is not None and ticket.from_peer
            return not from_peer and self.peer(url).usable()
        return self.gate_at(url).admits(ticket.token if ticket else None, mark)

    def peer(self, url: str) -> Peer:
        found = self._peers.get(url)
        if found is None:
            found = self._peers[url] = Peer(url)
        return found

    async def choose(self, model: str, token: str | None) -> direct.Target | None:
        """For the door: the replica (or peer) of `model` that LiteLLM's router picks among
        those that serve now, counted open there; None when the name has one deployment (the
        door's other ways take it). While none serves, waits up to the hold time (then
        HoldTimeout)."""
        group = self.runtimes.replicas_of(model) if self.runtimes is not None else None
        if group is None:
            return None
        state_dir = Path(os.environ["B70_STATE_DIR"])
        ticket = hold_mark.TICKET.get()
        first = self.gate_for(None)
        start = first.clock()
        limit = first.hold_s if _peer_limit() is None else 0.0
        while True:
            if ticket is not None:
                ticket.close()
            picked = await self._pick(group)
            mark = hold_mark.read_mark(state_dir)
            if picked is not None and self._admits(picked, ticket, mark):
                target = self._counted(picked, group, ticket, state_dir)
                if target is not None:
                    return target
            waited = first.clock() - start
            if waited >= limit:
                if ticket is not None:
                    ticket.close()
                retry = max(1, round(min(first.hold_s / 4, 30)))
                raise HoldTimeout(f"no replica of {group} serves", waited, retry)
            await first.sleep(min(POLL_S, limit - waited))

    def _counted(
        self, deployment: Any, group: str, ticket: hold_mark.Ticket | None, state_dir: Path
    ) -> direct.Target | None:
        """The target, its request counted open at a local replica; None if a switch marked
        that replica meanwhile (read after the count: a drain that reads after the mark sees
        the request)."""
        assert self.runtimes is not None
        found = self.runtimes.where(deployment)
        if found is None:
            return None
        url, is_peer = found
        if not is_peer:
            gate = self.gate_at(url)
            if ticket is not None:
                ticket.open(gate.open_requests)
            if not gate.admits(ticket.token if ticket else None, hold_mark.read_mark(state_dir)):
                return None
        return self.runtimes.target(deployment, group)

    async def _pick(self, group: str) -> Any:
        """LiteLLM's router's choice, by its routing strategy (its cooldowns and the filter
        above applied)."""
        try:
            return await mount.router().async_get_available_deployment(
                model=group, request_kwargs={}
            )
        except Exception:  # none it would choose (all cooling down): wait, then ask again
            return None

    def refused(self, target: direct.Target) -> None:
        """The replica or peer refused a request before its first byte: LiteLLM's router cools
        it down (shared with the other front doors through Redis, when configured)."""
        cooldown = getattr(mount.router(), "cooldown_cache", None)
        if cooldown is None or target.deployment_id is None:
            return
        with contextlib.suppress(Exception):  # a router that cannot: the filter still acts
            cooldown.add_deployment_to_cooldown(
                model_id=target.deployment_id,
                original_exception=ConnectionRefusedError("refused before its first byte"),
                exception_status=503,
                cooldown_time=None,  # the router's cooldown_time
            )

    async def readiness(self) -> tuple[bool, dict[str, str]]:
        """Whether this box serves: per runtime port's name, "ready", "switching" or "down"
        (its own runtimes only, never its peers'); ready when any name is."""
        if self.runtimes is None:
            return False, {}
        mark = hold_mark.read_mark(Path(os.environ["B70_STATE_DIR"]))
        names: dict[str, str] = {}
        for url in self.runtimes.urls:
            gate = self.gate_at(url)
            name = self.runtimes.name_at(url)
            if mark is not None and mark.holds(gate.port):
                state = "switching"
            else:
                state = "ready" if await gate.healthy() else "down"
            if names.get(name) != "ready":
                names[name] = state
        return any(state == "ready" for state in names.values()), names

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: Any
    ) -> dict[str, Any]:
        headers = _request_headers(data)
        token = headers.get(hold_mark.BYPASS_HEADER)
        model = data.get("model")
        if (
            self.runtimes is not None
            and isinstance(model, str)
            and self.runtimes.replicas_of(model)
        ):
            return data  # several replicas: the router's choice leaves out those held or down
        try:
            gate = self.gate_for(model if isinstance(model, str) else None)
            await gate.wait(token if isinstance(token, str) else None, limit_s=_peer_limit())
        except HoldTimeout as e:
            # LiteLLM's own error type: every route (chat, completions, streaming or not) keeps
            # its status, headers and message as they are.
            raise ProxyException(
                message=f"the model is not available: {e.why}; this request waited "
                f"{e.waited_s:.0f} s. Retry after {e.retry_after_s} s.",
                type="service_unavailable",
                param=None,
                code=503,
                headers={"Retry-After": str(e.retry_after_s)},
                openai_code="b70_hold_timeout",
            ) from None
        return data

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        """Errors name the runtime that serves, not LiteLLM's provider class."""
        error: Any = original_exception
        message = getattr(error, "message", None)
        if isinstance(message, str) and PROVIDER_ERROR in message:
            model = request_data.get("model")
            error.message = message.replace(
                PROVIDER_ERROR, self.runtime_name(model if isinstance(model, str) else None)
            )

    def runtime_name(self, model: str | None = None) -> str:
        """The runtime that serves `model` as it last named itself to the door."""
        backend = self.backend
        if self.runtimes is not None and model is not None:
            backend = self.runtimes.backend_of(model)
        facts = backend.known if backend is not None else None
        return f"the runtime ({facts.engine})" if facts is not None else "the runtime"


class Peer:
    """A peer appliance's readiness, asked beside the requests at most every HEALTH_TTL_S:
    it says whether the peer serves (not switching, a runtime healthy)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ready = True  # until it says otherwise
        self.asked_at = -math.inf
        self.asking: asyncio.Future[None] | None = None
        self._client: httpx.AsyncClient | None = None

    def usable(self) -> bool:
        if time.monotonic() - self.asked_at > HEALTH_TTL_S and (
            self.asking is None or self.asking.done()
        ):
            self.asking = asyncio.ensure_future(self._ask())
        return self.ready

    async def _ask(self) -> None:
        if self._client is None:  # created inside the proxy's event loop
            self._client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)
        try:
            answer = await self._client.get(self.url + door.READINESS_PATH)
            self.ready = answer.status_code == 200
        except httpx.TimeoutException:
            pass  # busy, not down: what it said last stands
        except httpx.HTTPError:
            self.ready = False
        self.asked_at = time.monotonic()


PROVIDER_ERROR = "Hosted_vllmException"  # LiteLLM's name for errors of the hosted_vllm route


async def wait_ready(limit_s: float, token: str | None) -> float | None:
    """For the door: hold a request whose runtime died until it serves again (or `limit_s`).
    `token`: the request's hold token; a switch's own verification passes its own hold."""
    gate = hold.gate_for(_asked())
    gate.healthy_until = -math.inf  # the runtime just failed: ask it, do not trust the cache
    try:
        peer = _peer_limit()
        return await gate.wait(token, limit_s=limit_s if peer is None else peer)
    except HoldTimeout:
        return None


async def hold_request(token: str | None) -> float:
    """For the door's fast way, which LiteLLM's pre-call hooks do not see: the same hold, but for
    /health. The request's own connection says whether the runtime serves (refused, or 503
    while it loads), and the door then holds it with wait_ready; no request waits for a probe,
    nor shares its worker with one, while the runtime answers."""
    return await hold.gate_for(_asked()).wait(token, health=False, limit_s=_peer_limit())


def _peer_limit() -> float | None:
    """How long a request may wait here: not at all when a peer's front door sent it (a 503
    now, and that door routes it to another box); else the hold time (None)."""
    ticket = hold_mark.TICKET.get()
    return 0.0 if ticket is not None and ticket.from_peer else None


def _asked() -> str | None:
    """The model name of the request being answered (the door's ticket carries it)."""
    ticket = hold_mark.TICKET.get()
    return ticket.model if ticket is not None else None


# Imported by the proxy: the door goes in front of LiteLLM's app (elsewhere this does nothing).
hold = HoldHook()
_runtimes = mount.install_in_proxy(wait_ready, hold_request, hold, readiness=hold.readiness)
hold.backend, hold.runtimes = (_runtimes.first if _runtimes else None), _runtimes
if _runtimes is not None and "B70_STATE_DIR" in os.environ:
    # This process's slot in each runtime's open count now, so a drain before the first request
    # reads 0 from the proxy rather than falling back to the runtime's metrics.
    for _url in _runtimes.urls:
        hold.gate_at(_url).open_requests.add(0)


# --- the API key --------------------------------------------------------------------------------


def _unauthorized(message: str) -> ProxyException:
    # ProxyException: LiteLLM's auth handler keeps its status, headers and message as they are.
    return ProxyException(
        message=message,
        type="authentication_error",
        param=None,
        code=401,
        headers={"WWW-Authenticate": "Bearer"},
        openai_code="invalid_api_key",
    )


async def authenticate(request: Request, api_key: str) -> UserAPIKeyAuth:
    """Accept exactly the appliance's key; anything else is a 401 that says what is wrong."""
    problem = door.key_problem(api_key, os.environ.get("LITELLM_MASTER_KEY", ""))
    if problem is not None:
        raise _unauthorized(problem)
    given = api_key.removeprefix("Bearer ").strip()
    return UserAPIKeyAuth(api_key=given, user_role=LitellmUserRoles.PROXY_ADMIN)
