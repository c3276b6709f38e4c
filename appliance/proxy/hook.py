"""The LiteLLM side of the appliance: the door, the request hold and the API-key check.

Loaded by the proxy through the rendered litellm.yaml:
    litellm_settings: callbacks: ["appliance.proxy.hook.hold"]
    general_settings: custom_auth: appliance.proxy.hook.authenticate

Importing it inside the proxy puts the door (appliance.proxy.door) in front of LiteLLM's app:
only the appliance's routes exist, and bad requests are refused before LiteLLM parses them.

The proxy unit tells this module where things are through its environment:
    B70_STATE_DIR       where `b70ctl switch` writes its hold mark (appliance.hold)
    B70_BACKEND_URL     the runtimes' addresses, one per runtime port (space-separated); each has
                        its own turnstile, whose /health is probed
    B70_HOLD_S          how long a request may wait before it is answered 503
    B70_MAX_BODY_BYTES  the largest request body the door takes (default 8 MiB)

A request waits while a switch of its model's runtime is marked or while that runtime is not
healthy, and goes through as soon as neither is true. A backend that is slow to answer /health
is busy, not down: only a refused connection or a non-200 answer holds requests.
"""

from __future__ import annotations

import math
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from fastapi import Request
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import LitellmUserRoles, ProxyException, UserAPIKeyAuth

from appliance import hold as hold_mark
from appliance.proxy import backend as backend_mod
from appliance.proxy import chain, log, mount, routing
from appliance.proxy.checks import Refusal
from appliance.proxy.waiting import HEALTH_TIMEOUT_S, HoldTimeout, Probe, Turnstile


def health_probe(backend_url: str) -> Probe:
    client: httpx.AsyncClient | None = None

    async def probe() -> bool:
        nonlocal client
        if client is None:  # created inside the proxy's event loop
            client = backend_mod.client_for(backend_url, timeout=HEALTH_TIMEOUT_S)
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


class HoldHook(routing.Routing, CustomLogger):
    def __init__(
        self,
        turnstile: Turnstile | None = None,
        backend: backend_mod.Backend | None = None,
        runtimes: mount.Runtimes | None = None,
    ) -> None:
        super().__init__()
        self._turnstile = turnstile  # one turnstile for every request (tests)
        self.backend = backend  # the door's view of the first runtime, to name it in errors
        self.runtimes = runtimes
        self._turnstiles: dict[str, Turnstile] = {}
        self._peers: dict[str, routing.Peer] = {}

    def turnstile_for(self, model: str | None) -> Turnstile:
        """The turnstile of the runtime that serves `model`."""
        if self._turnstile is not None:
            return self._turnstile
        if self.runtimes is not None:
            return self.turnstile_at(self.runtimes.url_of(model))
        return self.turnstile_at(os.environ["B70_BACKEND_URL"].split()[0])

    def turnstile_at(self, url: str) -> Turnstile:
        """The turnstile of the runtime at `url`, made on first use."""
        turnstile = self._turnstiles.get(url)
        if turnstile is None:
            env = os.environ
            turnstile = self._turnstiles[url] = Turnstile(
                Path(env["B70_STATE_DIR"]),
                health_probe(url),
                float(env.get("B70_HOLD_S", "300")),
                port=urllib.parse.urlsplit(url).port,
            )
        return turnstile

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
            turnstile = self.turnstile_for(model if isinstance(model, str) else None)
            await turnstile.wait(
                token if isinstance(token, str) else None, limit_s=routing.peer_limit()
            )
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


PROVIDER_ERROR = "Hosted_vllmException"  # LiteLLM's name for errors of the hosted_vllm route


async def wait_ready(limit_s: float, token: str | None) -> float:
    """For the door: hold a request whose runtime died until it serves again (or `limit_s`).
    `token`: the request's hold token; a switch's own verification passes its own hold."""
    turnstile = hold.turnstile_for(_asked())
    turnstile.healthy_until = -math.inf  # the runtime just failed: ask it, do not trust the cache
    peer = routing.peer_limit()
    return await turnstile.wait(token, limit_s=limit_s if peer is None else peer)  # or HoldTimeout


async def hold_request(token: str | None) -> float:
    """For the door's fast way, which LiteLLM's pre-call hooks do not see: the same hold, but for
    /health. The request's own connection says whether the runtime serves (refused, or 503
    while it loads), and the door then holds it with wait_ready; no request waits for a probe,
    nor shares its worker with one, while the runtime answers."""
    turnstile = hold.turnstile_for(_asked())
    return await turnstile.wait(token, health=False, limit_s=routing.peer_limit())


def hold_passes(token: str | None) -> bool:
    """For the door's fast way: whether the request may go on now, without leaving its task
    (else it waits in `hold_request`)."""
    return hold.turnstile_for(_asked()).pass_now(token)


def _asked() -> str | None:
    """The model name of the request being answered (the door's ticket carries it)."""
    ticket = hold_mark.TICKET.get()
    return ticket.model if ticket is not None else None


# Imported by the proxy: the door goes in front of LiteLLM's app (elsewhere this does nothing).
hold = HoldHook()
try:
    _runtimes = mount.install_in_proxy(
        wait_ready, hold_request, hold, readiness=hold.readiness, hold_now=hold_passes
    )
except mount.DoorNotMounted as _e:
    # Without the door, LiteLLM's own routes (admin, keys, UI) would answer the clients' key and
    # no request would be checked or held: the proxy does not serve at all. Exit status 3 is
    # gunicorn's "worker failed to boot", which stops its master too; in the master, it fails
    # the unit, whose journal has this line.
    log(f"b70: the door could not be mounted: {_e}; the proxy stops rather than serve without it")
    os._exit(3)
hold.backend, hold.runtimes = (_runtimes.first if _runtimes else None), _runtimes
if _runtimes is not None and "B70_STATE_DIR" in os.environ:
    # This process's slot in each runtime's open count now, so a drain before the first request
    # reads 0 from the proxy rather than falling back to the runtime's metrics.
    for _url in _runtimes.urls:
        hold.turnstile_at(_url).open_requests.add(0)


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
    """Accept the appliance's keys, as the door does (the master key and people's keys); anything
    else is a 401 that says what is wrong. The door checked the key already: only its own routes
    reach LiteLLM, whatever role LiteLLM gives."""
    try:
        chain.whose_key(mount.key_ring(), api_key)
    except Refusal as refusal:
        raise _unauthorized(refusal.message) from None
    given = chain.given_key(api_key)
    return UserAPIKeyAuth(api_key=given, user_role=LitellmUserRoles.PROXY_ADMIN)
