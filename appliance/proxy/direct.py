"""The fast way of a checked request when the model has one deployment: straight to the runtime.

The appliance serves each model name from one runtime at a time, on that name's runtime port
(runtimes that take turns under a name share its port), so LiteLLM's router has nothing to
choose, and its pass-through route (appliance.proxy.relay) would only add work to each request
(authentication again, the router, a logging object, a task in a thread pool), which a burst
waits for on each worker's event loop. Here the door sends the checked body itself, over a new
loopback connection (a kept one may be closed by the runtime just as it is used), written in the
same step as the door's checks (`open_with`), and relays the runtime's own bytes: what the
pass-through route relays.

The runtime receives the body as the door checked it, under the model name the router resolves
(an alias becomes the deployment's name), and no header of the client's. As on the pass-through
route, the answer is kept back until its first bytes: an error status, a refused or reset
connection, or a runtime that dies before its first event, and the request goes the full way
instead (LiteLLM's chat or completion route), which names the error, or waits for the runtime
and sends the request again. A client that leaves closes the connection to the runtime, which
then stops generating. The runtime has LiteLLM's `request_timeout` seconds for its first bytes and
for each next ones, as on the full way.

When the model has several deployments, or one that is not the appliance's runtime, the router
decides and the request takes the pass-through route.

Imported by the proxy: nothing from the rest of the controller but appliance.proxy.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import os
import socket
import ssl
import sys
import urllib.parse
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import h11

from appliance.proxy import Message, Receive, Send, apis, log
from appliance.proxy.backend import CHAT, COMPLETION
from appliance.proxy.checks import Refusal

# What became of a request sent here.
ANSWERED = "answered"  # its answer went to the client, whole or begun, or the client left
FULL_WAY = "full way"  # it failed before its first bytes: send it the full way
NOT_READY = "not ready"  # ... and the runtime is not serving (refused, closed, 503): wait first
REFUSED = "refused"  # the runtime answered an error status to one of appliance.proxy.apis' routes

ENDPOINTS = {CHAT: "/chat/completions", COMPLETION: "/completions"}
MAX_ERROR_BYTES = 65536  # of a runtime's error answer, kept to answer it in the API's shape
PROVIDER = "hosted_vllm/"  # the provider of the rendered deployment (templates/litellm.yaml.j2)
DEFAULT_TIMEOUT_S = 600.0  # LiteLLM's request_timeout, when the proxy does not say
READ_BYTES = 65536
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy's own server writes.
NOT_RELAYED = frozenset(
    (b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
     b"proxy-connection", b"server", b"date")
)  # fmt: skip


@dataclass
class Call:
    """One request the door sends straight to the runtime, through the layers of LiteLLM's that
    shape every answer's headers (appliance.proxy.mount.answer_layers), and what became of it."""

    target: Target
    kind: str
    body: bytes
    way: str = FULL_WAY
    error: tuple[int, bytes] | None = None  # REFUSED: the runtime's status and answer
    mend: Mend | None = None  # what the relayed answer passes through (appliance.proxy.apis)
    reached: bool = True  # False: nothing listened on the runtime's port (it does not serve)

    SCOPE_KEY: ClassVar[str] = "b70.direct"  # where the call rides in the request's ASGI scope

    @staticmethod
    async def endpoint(scope: Any, receive: Receive, send: Send) -> None:
        """The ASGI app inside the layers: it makes the call the scope carries."""
        call: Call = scope[Call.SCOPE_KEY]
        done = await exchange(
            call.target, call.kind, call.body, receive, send, timeout_s(), call.mend
        )
        call.way, call.error, call.reached = done.way, done.error, done.reached


@dataclass(frozen=True)
class Target:
    """Where a model's one deployment is served: the runtime's address and the name it serves."""

    host: str
    port: int
    base_path: str  # the deployment's api_base path, /v1
    model: str
    headers: tuple[tuple[str, str], ...] = ()  # a peer's: its key, and that it comes from a peer
    deployment_id: str | None = None  # the router's id of it, for its cooldown
    tls: bool = False  # an https:// peer


class Replicas(Protocol):
    """LiteLLM's router choosing among a model's several deployments on the appliance's runtimes
    (replicas, one per card), for the door to send the request there itself."""

    def serves(self, model: str) -> bool:
        """Whether the name is such a set (then `choose` holds its requests, not the door)."""
        ...

    async def choose(self, model: str, token: str | None) -> Target | None:
        """The replica the router picks among those that serve now (a switch's own request:
        among those it holds); None when the name is not such a set (the door's other ways
        take it). Waits while none serves; raises HoldTimeout when the hold time runs out."""
        ...

    def refused(self, target: Target) -> None:
        """The replica refused the request before its first byte: left out for a moment."""
        ...


MAX_REPLICA_TRIES = 8  # replicas tried for one request before it goes LiteLLM's full way


def origin_of(
    deployment: Mapping[str, Any], backend_urls: Collection[str], provider: str = PROVIDER
) -> str | None:
    """The address (one of `backend_urls`) of an OpenAI-compatible deployment of `provider`
    (the appliance's runtimes: `hosted_vllm/`; peers' proxies: `openai/`), or None."""
    params = deployment.get("litellm_params") or {}
    model, api_base = params.get("model"), params.get("api_base")
    if not (isinstance(model, str) and model.startswith(provider) and isinstance(api_base, str)):
        return None
    base = urllib.parse.urlsplit(api_base.rstrip("/"))
    origin = f"{base.scheme}://{base.netloc}"
    schemes = ("http", "https") if provider != PROVIDER else ("http",)  # a peer may be https
    if base.scheme not in schemes or origin not in {u.rstrip("/") for u in backend_urls}:
        return None
    if base.hostname is None or base.query or base.fragment:
        return None
    return origin


def target_of(
    deployments: Iterable[Mapping[str, Any]],
    name: str,
    backend_urls: Collection[str],
    provider: str = PROVIDER,
    headers: tuple[tuple[str, str], ...] = (),
) -> Target | None:
    """The runtime that serves `name`, when the router's only deployment of it is one of the
    appliance's runtimes (`backend_urls`; or of `provider` there, a peer's proxy); None
    otherwise."""
    found = [d for d in deployments if d.get("model_name") == name]
    if len(found) != 1 or origin_of(found[0], backend_urls, provider) is None:
        return None
    params = found[0]["litellm_params"]
    base = urllib.parse.urlsplit(params["api_base"].rstrip("/"))
    tls = base.scheme == "https"
    try:
        port = base.port or (443 if tls else 80)
    except ValueError:
        return None
    assert base.hostname is not None  # origin_of checked it
    served = params["model"].removeprefix(provider)
    deployment_id = (found[0].get("model_info") or {}).get("id")
    return Target(base.hostname, port, base.path, served, headers, deployment_id, tls)


def as_served(body: bytes, asked: str, target: Target) -> bytes:
    """The body under the name the runtime serves: unchanged unless the client used an alias."""
    if asked == target.model:
        return body
    data = json.loads(body)
    data["model"] = target.model
    return json.dumps(data, ensure_ascii=False).encode()


def timeout_s() -> float:
    """LiteLLM's request_timeout (litellm_settings in the rendered litellm.yaml)."""
    value = getattr(sys.modules.get("litellm"), "request_timeout", None)
    return float(value) if isinstance(value, int | float) and value > 0 else DEFAULT_TIMEOUT_S


async def relay(
    target: Target, kind: str, body: bytes, receive: Receive, send: Send, limit_s: float
) -> str:
    """Send the request to the runtime and relay its answer: ANSWERED, FULL_WAY or NOT_READY.
    `receive` gives the client's messages after its body: a disconnect."""
    return (await exchange(target, kind, body, receive, send, limit_s)).way


async def exchange(
    target: Target, kind: str, body: bytes, receive: Receive, send: Send, limit_s: float,
    mend: Mend | None = None,
) -> Done:  # fmt: skip
    """`relay`, with what became of the request: its way, and the runtime's error (REFUSED)."""
    connection = h11.Connection(h11.CLIENT)
    request = b"".join(connection.send(event) or b"" for event in _request(target, kind, body))
    try:
        reader, writer = await open_with(target.host, target.port, request, target.tls)
    except OSError:
        return Done(NOT_READY, reached=False)
    ongoing = _Exchange(target, kind, reader, writer, send, mend)
    done = ongoing.done
    # The body was read by the door: the client's next message says it left.
    watch = asyncio.ensure_future(receive())
    watch.add_done_callback(ongoing.client_left)
    try:
        async with asyncio.timeout(limit_s) as ongoing.deadline:
            done.way = await ongoing.run(connection, limit_s)
    except TimeoutError:
        done.way = ANSWERED
        if ongoing.begun:
            log(f"b70: the runtime sent nothing for {limit_s:g} s; its answer was cut there")
        else:
            await Refusal(
                504, f"the runtime did not answer within {limit_s:g} s (request_timeout)",
                "b70_runtime_timeout", kind="timeout",
            ).send(send)  # fmt: skip
    finally:
        watch.remove_done_callback(ongoing.client_left)
        watch.cancel()
        writer.transport.abort()
    return done


def endpoint_of(kind: str, base_path: str) -> str:
    """The runtime's path for a kind of request, its api_base's path being `base_path`."""
    if kind in ENDPOINTS:
        return base_path + ENDPOINTS[kind]
    return apis.endpoint_of(kind, base_path)


def _request(target: Target, kind: str, body: bytes) -> tuple[h11.Event, ...]:
    host = f"[{target.host}]" if ":" in target.host else target.host
    head = h11.Request(
        method="POST",
        target=endpoint_of(kind, target.base_path),
        headers=[
            ("Host", f"{host}:{target.port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
            *target.headers,
        ],
    )
    return head, h11.Data(data=body), h11.EndOfMessage()


async def open_with(
    host: str, port: int, request: bytes, tls: bool = False
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A new connection to the runtime, with the request written to it.

    On loopback the kernel has made the connection by the time connect() returns, so the
    request is written at once, in the same step of the request's task as the door's checks.
    In a burst, each request then reaches the runtime as soon as it was checked, instead of
    after the worker's loop has checked every request of the burst and come back to each
    connection (docs/proxy.md). Elsewhere (a peer on the network), and if the kernel did not
    take the request at once, the connection is opened the usual way."""
    if tls:  # an https:// peer, trusted as B70_PEER_CA says (else the system's trust)
        reader, writer = await asyncio.open_connection(
            host, port, ssl=peer_context(), server_hostname=host
        )
        writer.write(request)
        return reader, writer
    sock = _connect_at_once(host, port)
    if sock is None:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        return reader, writer
    try:
        sent = sock.send(request)
        reader, writer = await asyncio.open_connection(sock=sock)
    except BaseException:  # refused, reset, or the request cancelled (its client left)
        sock.close()
        raise
    writer.write(request[sent:])
    return reader, writer


_PEER_CONTEXT: list[ssl.SSLContext] = []


def peer_context() -> ssl.SSLContext:
    """The TLS client context for https:// peers, made once per worker (loading trust costs)."""
    if not _PEER_CONTEXT:
        _PEER_CONTEXT.append(ssl.create_default_context(cafile=os.environ.get("B70_PEER_CA")))
    return _PEER_CONTEXT[0]


def _connect_at_once(host: str, port: int) -> socket.socket | None:
    """A socket connected to a loopback address without waiting, or None when the address is
    not loopback or the connection is not made at once. Raises OSError when it is refused."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not address.is_loopback:
        return None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex((host, port))
        if code == errno.EINPROGRESS:  # on loopback the handshake is over by now, or refused
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code != 0:
            raise OSError(code, os.strerror(code))
        if _connected(sock):
            return sock
    except OSError:
        sock.close()
        raise
    sock.close()
    return None


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:  # ENOTCONN: the handshake is still under way
        return False
    return True


@dataclass
class Done:
    """What became of a request sent to the runtime."""

    way: str
    error: tuple[int, bytes] | None = None  # REFUSED: the runtime's status and answer
    reached: bool = True  # False: the connection to the runtime was refused


class _Exchange:
    """One request to the runtime and its answer, relayed as it comes."""

    def __init__(
        self, target: Target, kind: str, reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter, send: Send, mend: Mend | None = None,
    ) -> None:  # fmt: skip
        self.target = target
        self.kind = kind
        self.reader = reader
        self.writer = writer
        self.send = send
        self.mend = mend
        self.done = Done(FULL_WAY)
        self.begun = False  # a byte of the answer's body went to the client
        self.left = False  # the client left
        # Moved on with every read: like LiteLLM's own HTTP client, request_timeout bounds each
        # wait for the runtime (the first bytes, then each next ones), not a long stream whole.
        self.deadline: asyncio.Timeout | None = None

    def client_left(self, watch: asyncio.Future[Message]) -> None:
        if watch.cancelled() or watch.exception() is not None:
            return
        if watch.result().get("type") == "http.disconnect":
            self.left = True
            self.writer.transport.abort()  # the runtime sees it and stops generating

    async def run(self, connection: h11.Connection, limit_s: float) -> str:
        """The answer to the request `connection` has sent, relayed as it comes."""
        try:
            return await self._answer(connection, limit_s)
        except (OSError, h11.ProtocolError) as e:
            if self.left:
                return ANSWERED
            if self.begun:  # the answer stays unfinished, so the client sees it end early
                log(f"b70: the runtime's answer ended before its end ({type(e).__name__})")
                return ANSWERED
            return NOT_READY

    async def _answer(self, connection: h11.Connection, limit_s: float) -> str:
        start: Message | None = None
        loop = asyncio.get_running_loop()
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await self.reader.read(READ_BYTES))
                if self.deadline is not None:
                    self.deadline.reschedule(loop.time() + limit_s)
            elif isinstance(event, h11.Response):
                if event.status_code == 503:  # loading, or not serving
                    return NOT_READY
                if event.status_code >= 400 and self.kind in ENDPOINTS:
                    return FULL_WAY  # which names the error as LiteLLM does
                if event.status_code >= 400:  # the door answers it in the API's shape
                    self.done.error = (event.status_code, await self._whole(connection))
                    return REFUSED
                headers = [(k, v) for k, v in event.headers if k not in NOT_RELAYED]
                if self.mend is not None and _is_stream(headers):
                    headers = [(k, v) for k, v in headers if k != b"content-length"]
                else:
                    self.mend = None
                start = {"type": "http.response.start", "status": event.status_code,
                         "headers": headers}  # fmt: skip
            elif isinstance(event, h11.Data) and start is not None:
                data = self.mend.feed(bytes(event.data)) if self.mend else bytes(event.data)
                if not data:
                    continue
                if not self.begun:
                    self.begun = True
                    await self.send(start)
                await self.send({"type": "http.response.body", "body": data, "more_body": True})
            elif isinstance(event, h11.EndOfMessage) and start is not None:
                if not self.begun:
                    self.begun = True
                    await self.send(start)
                last = self.mend.end() if self.mend else b""
                await self.send({"type": "http.response.body", "body": last, "more_body": False})
                return ANSWERED
            elif isinstance(event, h11.ConnectionClosed):  # before the answer's end
                raise h11.RemoteProtocolError("the runtime closed the connection", 502)
            # else an informational answer (1xx): the answer follows

    async def _whole(self, connection: h11.Connection) -> bytes:
        """The rest of an answer's body, up to MAX_ERROR_BYTES of it."""
        chunks: list[bytes] = []
        size = 0
        while size < MAX_ERROR_BYTES:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await self.reader.read(READ_BYTES))
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
                size += len(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        return b"".join(chunks)[:MAX_ERROR_BYTES]


def _is_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


class Mend(Protocol):
    """What a streamed answer passes through on its way to the client (appliance.proxy.apis)."""

    def feed(self, data: bytes) -> bytes:
        """The bytes to send for these bytes of the runtime's (maybe none yet)."""
        ...

    def end(self) -> bytes:
        """The bytes to send when the runtime's answer ended."""
        ...
