"""Names served by several deployments: a runtime's replicas, one per card, and peer appliances'
proxies. LiteLLM's router picks one by its routing strategy; the hook (appliance.proxy.hook, of
which this is a part) leaves out what does not serve now, counts the request open where it goes,
and cools down what refused it; and it says whether this box serves (its readiness, which the
door answers for peers' front doors).

Imported by the proxy: nothing from the rest of the controller but appliance.proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any

import httpx

from appliance import hold as hold_mark
from appliance.proxy import backend, direct, door, mount
from appliance.proxy.waiting import HEALTH_TIMEOUT_S, HEALTH_TTL_S, POLL_S, HoldTimeout, Turnstile


def peer_limit() -> float | None:
    """How long a request may wait here: not at all when a peer's front door sent it (a 503
    now, and that door routes it to another box); else the hold time (None)."""
    ticket = hold_mark.TICKET.get()
    return 0.0 if ticket is not None and ticket.from_peer else None


class Routing:
    """The hook's part for names with several deployments (HoldHook keeps the turnstiles)."""

    runtimes: mount.Runtimes | None
    _peers: dict[str, Peer]

    def turnstile_for(self, model: str | None) -> Turnstile:
        raise NotImplementedError

    def turnstile_at(self, url: str) -> Turnstile:
        raise NotImplementedError

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
        return self.turnstile_at(url).admits(ticket.token if ticket else None, mark)

    def peer(self, url: str) -> Peer:
        found = self._peers.get(url)
        if found is None:
            found = self._peers[url] = Peer(url)
        return found

    def serves(self, model: str) -> bool:
        """For the door: whether `model` is served by several deployments (replicas, peers)."""
        return self.runtimes is not None and self.runtimes.replicas_of(model) is not None

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
        first = self.turnstile_for(None)
        start = first.clock()
        limit = first.hold_s if peer_limit() is None else 0.0
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
            turnstile = self.turnstile_at(url)
            if ticket is not None:
                ticket.open(turnstile.open_requests)
            token = ticket.token if ticket else None
            if not turnstile.admits(token, hold_mark.read_mark(state_dir)):
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

    async def readiness(self) -> bool:
        """Whether this box serves: one of its own runtimes (never a peer's) is healthy and not
        held by a switch."""
        if self.runtimes is None:
            return False
        mark = hold_mark.read_mark(Path(os.environ["B70_STATE_DIR"]))
        for url in self.runtimes.urls:
            turnstile = self.turnstile_at(url)
            if not (mark is not None and mark.holds(turnstile.port)) and await turnstile.healthy():
                return True
        return False


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
            self._client = backend.client_for(self.url, timeout=HEALTH_TIMEOUT_S)
        try:
            answer = await self._client.get(self.url + door.READINESS_PATH)
            self.ready = answer.status_code == 200
        except httpx.TimeoutException:
            pass  # busy, not down: what it said last stands
        except httpx.HTTPError:
            self.ready = False
        self.asked_at = time.monotonic()
