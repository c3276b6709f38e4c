"""A name served by several replicas (appliance.proxy.hook.HoldHook.choose): LiteLLM's own Router
picks among them by its routing strategy, and the hook's filter leaves out the replicas a
switch holds (a switch's own request goes only there) and one that refused a moment ago."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import litellm
import pytest

from appliance import hold
from appliance.proxy import hook as proxy_hook
from appliance.proxy import mount, waiting
from b70tools.net import free_port

PORTS = (8101, 8102, 8103)
COOLDOWN_S = 1.0
URLS = [f"http://127.0.0.1:{port}" for port in PORTS]


@pytest.fixture
def hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[proxy_hook.HoldHook]:
    deployments = [
        {
            "model_name": "small",
            "litellm_params": {"model": "hosted_vllm/small", "api_base": url + "/v1"},
        }
        for url in URLS
    ]
    deployments.append(
        {"model_name": "lone", "litellm_params": {"model": "hosted_vllm/lone", "api_base": URLS[0]}}
    )
    router = litellm.Router(
        model_list=deployments, model_group_alias={"default": "small"}, cooldown_time=COOLDOWN_S
    )
    monkeypatch.setitem(
        sys.modules, "litellm.proxy.proxy_server", types.SimpleNamespace(llm_router=router)
    )
    monkeypatch.setenv("B70_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("B70_HOLD_S", "0.5")
    h = proxy_hook.HoldHook(runtimes=mount.Runtimes(URLS))
    monkeypatch.setattr(litellm, "callbacks", [h])
    yield h


def picks(h: proxy_hook.HoldHook, token: str | None = None, n: int = 40) -> set[int]:
    async def choose() -> set[int]:
        out = set()
        for _ in range(n):
            hold.TICKET.set(hold.Ticket("small", token))
            target = await h.choose("small", token)
            assert target is not None and target.model == "small"
            out.add(target.port)
            hold.TICKET.get().close()  # type: ignore[union-attr]
        return out

    return asyncio.run(choose())


def test_the_router_spreads_requests_over_every_replica(hook: proxy_hook.HoldHook) -> None:
    assert picks(hook) == set(PORTS)
    assert asyncio.run(hook.choose("lone", None)) is None, "one deployment: the direct way"
    assert asyncio.run(hook.choose("default", None)) is not None, "an alias of the set"


def test_a_replica_being_switched_gets_only_the_switchs_own_requests(
    hook: proxy_hook.HoldHook, tmp_path: Path
) -> None:
    with hold.marked(tmp_path, "small-1", ports=(PORTS[1],)) as mark:
        assert picks(hook) == {PORTS[0], PORTS[2]}
        assert picks(hook, token=mark.token) == {PORTS[1]}


def test_a_request_is_counted_open_at_the_replica_chosen(
    hook: proxy_hook.HoldHook, tmp_path: Path
) -> None:
    async def one() -> int:
        hold.TICKET.set(ticket := hold.Ticket("small"))
        target = await hook.choose("small", None)
        assert target is not None
        assert hold.read_open(tmp_path, target.port) == 1
        ticket.close()
        assert hold.read_open(tmp_path, target.port) == 0
        return target.port

    asyncio.run(one())


def test_a_replica_that_refused_is_cooled_down_by_the_router(hook: proxy_hook.HoldHook) -> None:
    target = asyncio.run(hook.choose("small", None))
    assert target is not None and target.deployment_id
    hook.refused(target)
    assert target.port not in picks(hook)
    time.sleep(COOLDOWN_S + 0.1)
    assert picks(hook) == set(PORTS), "back once its cooldown ran out"


def test_when_every_replica_is_held_the_request_waits_then_gets_a_503(
    hook: proxy_hook.HoldHook, tmp_path: Path
) -> None:
    with hold.marked(tmp_path, "small", ports=PORTS), pytest.raises(waiting.HoldTimeout) as e:
        asyncio.run(hook.choose("small", None))
    assert e.value.why == "no replica of small serves" and e.value.waited_s >= 0.5


PEER = "http://127.0.0.1:9200"


def peer_router(monkeypatch: pytest.MonkeyPatch, **settings: object) -> litellm.Router:
    """One replica here and the same name at a peer's proxy, as rendered with [peers]."""
    deployments = [
        {"model_name": "small",
         "litellm_params": {"model": "hosted_vllm/small", "api_base": URLS[0] + "/v1"}},
        {"model_name": "small",
         "litellm_params": {"model": "openai/small", "api_base": PEER + "/v1", "api_key": "k"}},
    ]  # fmt: skip
    router = litellm.Router(model_list=deployments, cooldown_time=5, **settings)  # type: ignore[arg-type]
    monkeypatch.setitem(
        sys.modules, "litellm.proxy.proxy_server", types.SimpleNamespace(llm_router=router)
    )
    return router


def test_a_peer_is_one_more_deployment_reached_with_the_fleets_key(
    hook: proxy_hook.HoldHook, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer_router(monkeypatch)
    monkeypatch.setenv("LITELLM_MASTER_KEY", "sk-fleet")
    hook.runtimes = mount.Runtimes(URLS[:1], [PEER])
    assert picks(hook) == {PORTS[0], 9200}
    hold.TICKET.set(hold.Ticket("small"))
    while (target := asyncio.run(hook.choose("small", None))) and target.port != 9200:
        pass
    assert target is not None and dict(target.headers) == {
        "Authorization": "Bearer sk-fleet",
        "x-b70-peer": "1",
    }

    async def from_peer() -> set[int]:
        out = set()
        for _ in range(20):
            hold.TICKET.set(hold.Ticket("small", None, from_peer=True))
            found = await hook.choose("small", None)
            assert found is not None
            out.add(found.port)
        return out

    assert asyncio.run(from_peer()) == {PORTS[0]}, "a peer's request stays on this box"
    peer = hook.peer(PEER)
    peer.ready, peer.asked_at = False, time.monotonic() + 60  # its readiness said: not serving
    assert picks(hook) == {PORTS[0]}


def test_two_front_doors_share_cooldowns_through_redis(
    hook: proxy_hook.HoldHook, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Front door A finds the peer refusing and cools it down; front door B, which shares
    A's Redis (a real redis-server), leaves the peer out from its first request on."""
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.fail("redis-server is not installed: scripts/bootstrap --test installs it (as root)")
    port = free_port()
    server = subprocess.Popen(
        [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port)
        hook.runtimes = mount.Runtimes(URLS[:1], [PEER])
        a = peer_router(monkeypatch, redis_host="127.0.0.1", redis_port=port)
        b = litellm.Router(
            model_list=a.get_model_list(), cooldown_time=5, redis_host="127.0.0.1",
            redis_port=port,
        )  # fmt: skip
        alone = litellm.Router(model_list=a.get_model_list(), cooldown_time=5)  # no Redis
        peer = hook.peer(PEER)
        peer.ready, peer.asked_at = True, time.monotonic() + 60  # its readiness: serving
        hold.TICKET.set(hold.Ticket("small"))
        while (target := asyncio.run(hook.choose("small", None))) and target.port != 9200:
            pass
        assert target is not None
        hook.refused(target)  # front door A: the peer refused
        for router, expected in ((b, {PORTS[0]}), (alone, {PORTS[0], 9200})):
            as_it = types.SimpleNamespace(llm_router=router)
            monkeypatch.setitem(sys.modules, "litellm.proxy.proxy_server", as_it)
            assert picks(hook) == expected, "B saw A's cooldown; a door without Redis did not"
    finally:
        server.terminate()
        server.wait(timeout=10)


def wait_for_port(port: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
