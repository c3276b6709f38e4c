"""The door's way straight to the runtime (appliance.proxy.direct): which requests take it, and
the exchange, against a real TCP server in the test's event loop (tests/directkit.py); the same
way runs inside the real proxy in tests/test_door_real.py."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import types
from typing import Any

import pytest

from appliance.proxy import direct, mount
from appliance.proxy.backend import CHAT, COMPLETION
from tests.directkit import BODY, Client, Runtime, Script, answer, relay, stream

# --- which requests go straight to the runtime ------------------------------------------------


def deployment(name: str, model: str, api_base: str) -> dict[str, Any]:
    return {"model_name": name, "litellm_params": {"model": model, "api_base": api_base}}


BACKEND = "http://127.0.0.1:8001"


@pytest.mark.parametrize(
    ("deployments", "expected"),
    [
        ([deployment("smollm2", "hosted_vllm/smollm2", BACKEND + "/v1")],
         direct.Target("127.0.0.1", 8001, "/v1", "smollm2")),
        ([deployment("smollm2", "hosted_vllm/served", BACKEND + "/v1/")],
         direct.Target("127.0.0.1", 8001, "/v1", "served")),
        # the router chooses between several deployments
        ([deployment("smollm2", "hosted_vllm/smollm2", BACKEND + "/v1")] * 2, None),
        ([deployment("other", "hosted_vllm/other", BACKEND + "/v1")], None),
        # not the appliance's runtime: another provider, another address, TLS
        ([deployment("smollm2", "openai/smollm2", BACKEND + "/v1")], None),
        ([deployment("smollm2", "hosted_vllm/smollm2", "http://10.0.0.2:8001/v1")], None),
        ([deployment("smollm2", "hosted_vllm/smollm2", "https://127.0.0.1:8001/v1")], None),
        ([deployment("smollm2", "hosted_vllm/smollm2", BACKEND + "/v1?x=1")], None),
        ([{"model_name": "smollm2", "litellm_params": {"model": "hosted_vllm/smollm2"}}], None),
    ],
)  # fmt: skip
def test_a_model_goes_straight_to_the_runtime_only_when_that_is_its_one_deployment(
    deployments: list[dict[str, Any]], expected: direct.Target | None
) -> None:
    assert direct.target_of(deployments, "smollm2", [BACKEND]) == expected


def test_an_alias_is_looked_up_in_the_router_and_sent_under_the_served_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    router = types.SimpleNamespace(
        model_list=[deployment("smollm2", "hosted_vllm/smollm2", BACKEND + "/v1")],
        model_group_alias={"default": "smollm2", "hidden": {"model": "smollm2", "hidden": True}},
    )
    server = types.SimpleNamespace(llm_router=router)
    monkeypatch.setitem(sys.modules, "litellm.proxy.proxy_server", server)
    target_of = mount.direct_to([BACKEND])
    expected = direct.Target("127.0.0.1", 8001, "/v1", "smollm2")
    assert target_of("smollm2") == target_of("default") == target_of("hidden") == expected
    assert target_of("unknown") is None
    assert direct.as_served(BODY, "smollm2", expected) is BODY
    aliased = json.loads(BODY) | {"model": "default", "temperature": 0.5, "text": "ünï"}
    sent = json.loads(direct.as_served(json.dumps(aliased).encode(), "default", expected))
    assert sent == aliased | {"model": "smollm2"}
    monkeypatch.setattr(server, "llm_router", None)
    assert target_of("smollm2") is None


def test_runtimes_side_by_side_are_each_the_one_deployment_of_their_own_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two runtimes on their own cards and ports: each name goes straight to its own runtime,
    and the door asks and holds that runtime for it (mount.Runtimes)."""
    other = "http://127.0.0.1:8002"
    router = types.SimpleNamespace(
        model_list=[
            deployment("smollm2", "hosted_vllm/smollm2", BACKEND + "/v1"),
            deployment("vision", "hosted_vllm/vision", other + "/v1"),
            deployment("elsewhere", "hosted_vllm/elsewhere", "http://10.0.0.2:8000/v1"),
        ],
        model_group_alias={"default": "smollm2"},
    )
    monkeypatch.setitem(
        sys.modules, "litellm.proxy.proxy_server", types.SimpleNamespace(llm_router=router)
    )
    target_of = mount.direct_to([BACKEND, other])
    assert target_of("vision") == direct.Target("127.0.0.1", 8002, "/v1", "vision")
    assert target_of("default") == direct.Target("127.0.0.1", 8001, "/v1", "smollm2")
    assert target_of("elsewhere") is None
    runtimes = mount.Runtimes([BACKEND, other])
    assert runtimes.url_of("vision") == other
    assert runtimes.url_of("default") == runtimes.url_of("smollm2") == BACKEND
    assert runtimes.url_of("unknown") == runtimes.url_of(None) == BACKEND, "the first runtime's"
    assert runtimes.backend_of("vision").url == other


# --- the connection ---------------------------------------------------------------------------


def test_a_loopback_connection_is_made_and_its_request_written_without_waiting() -> None:
    """In a burst, a request reaches the runtime in the step of its task that checked it
    (docs/proxy.md): on loopback the kernel has made the connection when connect() returns."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        sock = direct._connect_at_once("127.0.0.1", port)
        assert sock is not None and sock.getpeername() == ("127.0.0.1", port)
        sock.close()
        listener.accept()[0].close()
        # not loopback, or a name: opened the usual way, by the event loop
        assert direct._connect_at_once("localhost", port) is None
        assert direct._connect_at_once("192.0.2.1", port) is None
        for host in ("127.0.0.1", "localhost"):
            asyncio.run(_opened(host, port))
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.recv(100) == b"POST / ..."
    with pytest.raises(ConnectionRefusedError):
        direct._connect_at_once("127.0.0.1", port)  # nothing listens there now


async def _opened(host: str, port: int) -> None:
    _, writer = await direct.open_with(host, port, b"POST / ...")
    await writer.drain()
    writer.close()


# --- the exchange ------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "path"), [(CHAT, b"/v1/chat/completions"),
                                             (COMPLETION, b"/v1/completions")])  # fmt: skip
def test_an_answer_is_relayed_as_the_runtime_gave_it(kind: str, path: bytes) -> None:
    runtime, client = Runtime(answer(200, b'{"id": "x"}')), Client()
    assert relay(runtime, client, kind) == direct.ANSWERED
    assert (client.status, client.body, client.finished) == (200, b'{"id": "x"}', True)
    assert client.headers == {b"content-type": b"application/json", b"content-length": b"11"}
    ((head, body),) = runtime.requests
    assert head.startswith(b"POST " + path + b" HTTP/1.1\r\n") and body == BODY
    sent = {line.split(b":")[0].lower() for line in head.split(b"\r\n")[1:] if line}
    assert sent == {b"host", b"content-type", b"content-length", b"connection"}


def test_a_stream_is_relayed_event_by_event_to_its_end() -> None:
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    runtime, client = Runtime(stream(events)), Client()
    assert relay(runtime, client) == direct.ANSWERED
    assert client.status == 200 and client.headers == {b"content-type": b"text/event-stream"}
    assert [m["body"] for m in client.messages[1:-1]] == events
    assert client.finished


@pytest.mark.parametrize(
    ("script", "way"),
    [
        (answer(503, b'{"error": "Loading model"}'), direct.NOT_READY),
        (answer(400, b'{"error": "bad"}'), direct.FULL_WAY),
        (answer(500, b'{"error": "boom"}'), direct.FULL_WAY),
        (stream([], end=False), direct.NOT_READY),  # died after its status line
    ],
)
def test_an_answer_that_fails_before_its_first_bytes_is_kept_back(script: Script, way: str) -> None:
    client = Client()
    assert relay(Runtime(script), client) == way
    assert client.messages == []


def test_a_runtime_that_refuses_the_connection_is_not_ready() -> None:
    async def scenario() -> str:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = Client()
        target = direct.Target("127.0.0.1", port, "/v1", "smollm2")
        return await direct.relay(target, CHAT, BODY, client.receive, client.send, 5)

    assert asyncio.run(scenario()) == direct.NOT_READY


def test_an_answer_that_has_begun_is_never_taken_back_and_is_left_unfinished() -> None:
    """The runtime dies after its first event: the client has it, and its answer does not end
    as a whole answer would (so the server closes the connection without a last chunk)."""
    runtime, client = Runtime(stream([b"data: 1\n\n"], end=False)), Client()
    assert relay(runtime, client) == direct.ANSWERED
    assert client.body == b"data: 1\n\n" and not client.finished


def test_a_client_that_leaves_closes_the_connection_to_the_runtime() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async def scenario() -> tuple[str, bool]:
        client = Client()
        async with Runtime(endless) as runtime:
            relaying = asyncio.ensure_future(
                direct.relay(runtime.target(), CHAT, BODY, client.receive, client.send, 10)
            )
            while len(client.messages) < 3:
                await asyncio.sleep(0.01)
            client.leave.set()
            way = await asyncio.wait_for(relaying, 5)
            return way, not client.finished

    way, unfinished = asyncio.run(scenario())
    assert way == direct.ANSWERED and unfinished


def test_the_request_timeout_bounds_each_wait_not_a_long_stream() -> None:
    """Like LiteLLM's HTTP client: a stream longer than the timeout, whose events come in time,
    ends whole; one that falls silent past it is cut, unfinished."""

    def slow(events: int, gap_s: float, then_silent: bool = False) -> Script:
        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(events):
                writer.write(b"9\r\ndata: 1\n\n\r\n")
                await writer.drain()
                await asyncio.sleep(gap_s)
            if then_silent:
                await asyncio.sleep(30)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        return script

    client = Client()
    assert relay(Runtime(slow(6, 0.04)), client, limit_s=0.15) == direct.ANSWERED
    assert client.body == b"data: 1\n\n" * 6 and client.finished
    client = Client()
    assert relay(Runtime(slow(2, 0.02, then_silent=True)), client, limit_s=0.15) == direct.ANSWERED
    assert client.body == b"data: 1\n\n" * 2 and not client.finished


def test_a_runtime_silent_past_the_request_timeout_is_a_504() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    client = Client()
    assert relay(Runtime(silent), client, limit_s=0.1) == direct.ANSWERED
    assert client.status == 504
    error = json.loads(client.body)["error"]
    assert error["code"] == "b70_runtime_timeout" and "0.1 s" in error["message"]
