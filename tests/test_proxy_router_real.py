"""A name served by several replicas (appliance.proxy.hook.HoldHook.choose): LiteLLM's own Router
picks among them by its routing strategy, and the hook's filter leaves out the replicas a
switch holds (a switch's own request goes only there) and one that refused a moment ago."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import litellm
import pytest

from appliance.proxy import hold, mount, waiting
from appliance.proxy import hook as proxy_hook

PORTS = (8101, 8102, 8103)
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
    router = litellm.Router(model_list=deployments, model_group_alias={"default": "small"})
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


def test_a_replica_that_refused_is_left_out_for_a_moment(hook: proxy_hook.HoldHook) -> None:
    target = asyncio.run(hook.choose("small", None))
    assert target is not None
    hook.refused(target)
    assert target.port not in picks(hook)
    hook.gate_at(f"http://127.0.0.1:{target.port}").refused_until -= waiting.REFUSED_S
    assert picks(hook) == set(PORTS)


def test_when_every_replica_is_held_the_request_waits_then_gets_a_503(
    hook: proxy_hook.HoldHook, tmp_path: Path
) -> None:
    with hold.marked(tmp_path, "small", ports=PORTS), pytest.raises(waiting.HoldTimeout) as e:
        asyncio.run(hook.choose("small", None))
    assert e.value.why == "no replica of small serves" and e.value.waited_s >= 0.5
