"""TLS on the proxy's port (`[proxy] tls`), beside plain HTTP on the same port.

Each connection's first byte says which it speaks: a TLS record of the handshake (0x16) begins
every TLS connection, and no HTTP request begins with it. The port stays systemd's socket
(socket activation, its backlog while the proxy restarts), and every connection is read by
uvicorn's own HTTP protocol, over TLS or not, so keep-alive and streaming are as before.
uvicorn takes this as its HTTP protocol class (`beside_plain`, its Config's `http=`), which the
proxy's gunicorn worker gives it (appliance.proxy.mount). Not uvicorn's or gunicorn's own ssl
options: they make every connection on the port TLS, and loopback's plain HTTP would go.

Plain HTTP stays for this machine: `b70ctl`, the monitor and the health gate talk to loopback.
A request in plain HTTP from another machine is refused (`InClear`), its key having
crossed the network in clear: the answer says to use https:// and which certificate to trust.

The first bytes are read as they come (an event loop's `start_tls` cannot take bytes already
read, and uvloop reads before a new connection's protocol can pause it): plain HTTP goes to
uvicorn's protocol as it is; TLS goes through the ssl module's in-memory TLS (`Tls`).
A certificate file that changes (a renewal) is served to the connections after it, without a
restart; one that does not load keeps the last one, and the journal says so once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.keys import file_fingerprint, server_context
from appliance.proxy import log
from appliance.proxy.checks import Refusal

HANDSHAKE = 0x16  # the first byte of a TLS record that carries a handshake (RFC 8446, 5.1)
FIRST_BYTES_S = 10.0  # a connection with no request in this is closed (a handshake is no request)
READ_BYTES = 64 * 1024  # at most, per read of the decrypted stream
LOOK_S = 5.0  # how often the certificate files are looked at, at most
_HEX_COLON = "0123456789abcdefABCDEF:."


class Certificate:
    """The context the proxy serves, loaded again when its files change."""

    def __init__(self, cert: Path, key: Path, clock: Callable[[], float] = time.monotonic):
        self.cert, self.key, self.clock = cert, key, clock
        self.context = server_context(cert, key)  # at start: a bad file stops the proxy
        self.fingerprint = file_fingerprint(cert) or "?"
        self.stamp = self._stamp()
        self.looked = clock()
        self.said: str | None = None

    def _stamp(self) -> tuple[int, ...]:
        out: list[int] = []
        for path in (self.cert, self.key):
            with contextlib.suppress(OSError):
                st = path.stat()
                out += [st.st_ino, st.st_mtime_ns, st.st_size]
        return tuple(out)

    def now(self) -> ssl.SSLContext:
        """The context for a new connection (its files looked at every LOOK_S at most)."""
        if self.clock() - self.looked < LOOK_S:
            return self.context
        self.looked = self.clock()
        stamp = self._stamp()
        if stamp == self.stamp:
            return self.context
        try:
            context = server_context(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            problem = f"b70: cannot load the TLS certificate {self.cert} again: {e}"
            if problem != self.said:
                self.said = problem
                log(problem + "; the last one that loaded is served")
            return self.context
        self.context, self.stamp, self.said = context, stamp, None
        self.fingerprint = file_fingerprint(self.cert) or "?"
        log(f"b70: serving the TLS certificate {self.cert} again, SHA-256 {self.fingerprint}")
        return self.context


class FirstByte(asyncio.Protocol):
    """A new connection: its first bytes say whether it speaks TLS; then it is uvicorn's
    protocol's, as it is or through a Tls transport."""

    def __init__(self, inner: Callable[[], asyncio.Protocol], certificate: Certificate) -> None:
        self.inner, self.certificate = inner, certificate
        self.transport: Any = None  # uvloop's, or asyncio's
        self.tls: Tls | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(FIRST_BYTES_S, self._silent)

    def _silent(self) -> None:
        """No request in time, in clear or over TLS (a handshake alone is no request): the
        connection is closed, as uvicorn closes one idle after its last answer."""
        self.timer = None
        if self.tls is None or not self.tls.delivered:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.tls is not None:
            self.tls.received(data)
            if self.tls.delivered and self.timer is not None:
                self.timer.cancel()
                self.timer = None
            return
        if self.timer is not None and data:
            if data[0] == HANDSHAKE:
                self.tls = Tls(self.transport, self.certificate.now(), self.inner)
                self.data_received(data)  # the handshake's first bytes
                return
            self.timer.cancel()
            self.timer = None
        protocol = self.inner()  # plain HTTP: uvicorn's protocol takes the connection as it is
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        protocol.data_received(data)

    def eof_received(self) -> bool | None:
        return self.tls.eof_received() if self.tls is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.tls is not None:
            self.tls.lost(exc)

    def pause_writing(self) -> None:
        if self.tls is not None and self.tls.protocol is not None:
            self.tls.protocol.pause_writing()

    def resume_writing(self) -> None:
        if self.tls is not None and self.tls.protocol is not None:
            self.tls.protocol.resume_writing()


class Tls(asyncio.Transport):
    """TLS over a connection whose first bytes were read already: the ssl module's in-memory
    TLS (ssl.MemoryBIO) between the socket's transport and uvicorn's protocol, which sees a
    transport with an `sslcontext` (so its requests' scheme is https)."""

    def __init__(
        self, raw: Any, context: ssl.SSLContext, inner: Callable[[], asyncio.Protocol]
    ) -> None:
        super().__init__()
        self.raw, self.context, self.inner = raw, context, inner
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.handshaken = False
        self.delivered = False  # bytes of a request reached uvicorn's protocol
        self.protocol: asyncio.Protocol | None = None
        self.closing = False

    # --- from the socket
    def received(self, data: bytes) -> None:
        self.incoming.write(data)
        try:
            if not self.handshaken:
                try:
                    self.tls.do_handshake()
                except ssl.SSLWantReadError:
                    return
                finally:
                    self._flush()
                self.handshaken = True
                self.protocol = self.inner()
                self.protocol.connection_made(self)
            self._read()
        except (ssl.SSLError, OSError):
            self._flush()  # the alert that says why, if there is one
            self.raw.abort()

    def _read(self) -> None:
        while self.protocol is not None:
            try:
                chunk = self.tls.read(READ_BYTES)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                chunk = b""
            if not chunk:  # the client's close_notify (the ssl module reads it as no bytes)
                self.eof_received()  # answered with ours, and the connection closed
                break
            self.delivered = True
            self.protocol.data_received(chunk)
        self._flush()

    def eof_received(self) -> bool | None:
        if self.protocol is None or not self.protocol.eof_received():
            self.close()
        return True

    def lost(self, exc: Exception | None) -> None:
        if self.protocol is not None:
            protocol, self.protocol = self.protocol, None
            protocol.connection_lost(exc)

    def _flush(self) -> None:
        out = self.outgoing.read()
        if out and not self.raw.is_closing():
            self.raw.write(out)

    # --- from uvicorn's protocol
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closing or not data:
            return
        try:
            self.tls.write(data)
        except ssl.SSLError:
            self.raw.abort()
            return
        self._flush()

    def writelines(self, chunks: Any) -> None:
        self.write(b"".join(chunks))

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(ssl.SSLError):
            self.tls.unwrap()  # our close_notify; the client's is not waited for
        self._flush()
        self.raw.close()

    def abort(self) -> None:
        self.closing = True
        self.raw.abort()

    def is_closing(self) -> bool:
        return self.closing or bool(self.raw.is_closing())

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.raw.pause_reading()

    def resume_reading(self) -> None:
        self.raw.resume_reading()

    def is_reading(self) -> bool:
        return bool(self.raw.is_reading())

    def get_write_buffer_size(self) -> int:
        return int(self.raw.get_write_buffer_size())

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.raw.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        assert isinstance(protocol, asyncio.Protocol)
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sslcontext":
            return self.context
        if name == "ssl_object":
            return self.tls
        if name == "peercert":
            return self.tls.getpeercert()
        if name == "cipher":
            return self.tls.cipher()
        return self.raw.get_extra_info(name, default)


def beside_plain(certificate: Certificate) -> type[asyncio.Protocol]:
    """The HTTP protocol class for uvicorn's Config (its `http=`, which takes a class as well as
    a name): each new connection starts with FirstByte, then is uvicorn's own protocol ("auto":
    httptools when installed, else h11), over TLS or as it is. appliance.proxy.mount gives it to
    each worker through uvicorn-worker's CONFIG_KWARGS."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class BesidePlain(FirstByte):
        def __init__(self, **kwargs: Any) -> None:  # config, server_state, app_state, _loop
            super().__init__(lambda: AutoHTTPProtocol(**kwargs), certificate)

    return BesidePlain


# --- the door's side ----------------------------------------------------------------------------


def same_machine(scope: Any) -> bool:
    """Whether the request comes from this machine: loopback, or the address it came to (a
    proxy that listens on one of the machine's addresses is reached from it through that one).
    Behind a reverse proxy on loopback, uvicorn has put the forwarded client here already."""
    client, server = scope.get("client"), scope.get("server")
    host = client[0] if client else None
    if not host:
        return False  # a Unix socket has no client address: not ours to guess
    try:
        if ipaddress.ip_address(host.split("%", 1)[0]).is_loopback:
            return True
    except ValueError:
        return False
    return bool(server) and server[0] == host


class InClear:
    """Refuses a request in plain HTTP from another machine when TLS is on."""

    def __init__(self, certificate: Certificate) -> None:
        self.certificate = certificate

    def __call__(self, scope: Any) -> Refusal | None:
        if scope.get("scheme") != "http" or same_machine(scope):
            return None
        host = _host_of(scope) or "THIS-HOST"
        server = scope.get("server")
        port = f":{server[1]}" if server and server[1] else ""
        self.certificate.now()  # a renewed certificate's fingerprint
        return Refusal(
            403,
            f"this appliance takes requests from other machines over TLS only: use "
            f"https://{host}{port} instead of http://, and trust its certificate, whose "
            f"SHA-256 fingerprint is {self.certificate.fingerprint} (`b70ctl status` on the "
            "appliance shows it). The key this request carried crossed the network in clear: "
            "ask for it to be rotated (`b70ctl keys rotate NAME`).",
            "tls_required",
            kind="permission_error",
        )


def _host_of(scope: Any) -> str | None:
    """The name the client used for this machine (its Host header, less the port)."""
    for key, value in scope.get("headers", ()):
        if key == b"host":
            text = bytes(value).decode("latin-1")
            if text.startswith("["):
                inside = text[1:].split("]", 1)[0]
                return f"[{inside}]" if inside and set(inside) <= set(_HEX_COLON) else None
            name = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
            return name if name and all(c.isalnum() or c in ".-" for c in name) else None
    return None
