"""TLS on the proxy's port, in milliseconds: the config's words, the certificate install makes
(its names, key, fingerprint, renewal), a port that speaks TLS and plain HTTP side by side on
both event loops the proxy may run (asyncio's, uvloop's), the same in a real uvicorn server given
the door's protocol class as the proxy's workers give it, clients that misbehave, and the door's
refusal of plain HTTP from afar."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import uvloop

from appliance import keys
from appliance.config import reader
from appliance.deploy import certificate
from appliance.errors import ApplianceError, ConfigError
from appliance.layout import Layout, Scope
from appliance.proxy import mount
from appliance.proxy.share import tls
from tests.conftest import REPO

NAMES = (["localhost", "box.example"], ["127.0.0.1", "::1", "192.0.2.9"])


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tls")
    cert, key = certificate.make_self_signed(NAMES)
    (root / "tls.crt").write_text(cert)
    (root / "tls.key").write_text(key)
    return root / "tls.crt", root / "tls.key"


def _config(tmp_path: Path, proxy: str) -> Any:
    text = (REPO / "examples" / "demo.toml").read_text()
    path = tmp_path / "b70.toml"
    path.write_text(text.replace("[proxy]\n", "[proxy]\n" + proxy + "\n", 1))
    return reader.load(path)


# --- the config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("proxy", "says"),
    [
        ('tls_cert = "/a.pem"\ntls_key = "/a.key"', "is set but tls is false"),
        ('tls = true\ntls_cert = "/a.pem"', "is set without tls_key"),
        ('tls = true\ntls_key = "/a.key"', "is set without tls_cert"),
        ('tls = true\ntls_cert = "a.pem"\ntls_key = "/a.key"', "must be an absolute path"),
        ('tls = "on"', "must be true or false"),
    ],
)
def test_bad_tls_settings_are_named(tmp_path: Path, proxy: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _config(tmp_path, proxy)


def _peers(tmp_path: Path, peers: str) -> Any:
    text = (REPO / "examples" / "demo.toml").read_text() + "\n[peers]\n" + peers + "\n"
    path = tmp_path / "b70.toml"
    path.write_text(text)
    return reader.load(path)


def test_https_peers_and_the_certificates_they_are_trusted_by(tmp_path: Path) -> None:
    both = _peers(
        tmp_path, 'urls = ["https://10.0.0.2:8000", "http://10.0.0.3:8000"]\nca = "/ca.pem"'
    )
    assert both.peers.ca == "/ca.pem" and both.peers.urls[0] == "https://10.0.0.2:8000"
    with pytest.raises(ConfigError, match="is for https:// peers"):
        _peers(tmp_path, 'urls = ["http://10.0.0.2:8000"]\nca = "/ca.pem"')
    with pytest.raises(ConfigError, match="not an http:// or https://HOST:PORT"):
        _peers(tmp_path, 'urls = ["ftp://10.0.0.2:8000"]')


def test_tls_files_are_the_owners_or_made_in_the_state_directory(tmp_path: Path) -> None:
    off = _config(tmp_path, "").proxy
    assert keys.tls_files(off.tls, off.tls_cert, off.tls_key, tmp_path) is None
    own = _config(tmp_path, 'tls = true\ntls_cert = "/c.pem"\ntls_key = "/k.pem"').proxy
    assert keys.tls_files(own.tls, own.tls_cert, own.tls_key, tmp_path) == keys.TlsFiles(
        Path("/c.pem"), Path("/k.pem"), made=False
    )
    self_signed = _config(tmp_path, "tls = true").proxy
    files = keys.tls_files(self_signed.tls, None, None, tmp_path)
    assert files == keys.TlsFiles(tmp_path / "tls.crt", tmp_path / "tls.key", made=True)


# --- the certificate ----------------------------------------------------------------------------


def test_the_fingerprint_is_openssls(made: tuple[Path, Path]) -> None:
    out = subprocess.run(
        ["openssl", "x509", "-in", str(made[0]), "-noout", "-fingerprint", "-sha256"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert keys.file_fingerprint(made[0]) == out.stdout.strip().split("=", 1)[1]
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(made[0].read_text())).hexdigest().upper()
    assert keys.file_fingerprint(made[0]) == ":".join(
        digest[i : i + 2] for i in range(0, len(digest), 2)
    )
    assert keys.fingerprint("no certificate here") is None
    assert keys.fingerprint("-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----") is None
    assert keys.file_fingerprint(made[0].with_name("missing.crt")) is None


def test_the_self_signed_certificate_names_the_machine_and_only_serves(
    made: tuple[Path, Path],
) -> None:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    cert = x509.load_pem_x509_certificate(made[0].read_bytes())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert alt.get_values_for_type(x509.DNSName) == NAMES[0]
    assert [str(a) for a in alt.get_values_for_type(x509.IPAddress)] == NAMES[1]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    days = (cert.not_valid_after_utc - cert.not_valid_before_utc).days
    assert days == certificate.VALID_DAYS
    keys.server_context(*made)  # the key is the certificate's


def test_machine_names_leave_out_what_no_client_uses() -> None:
    dns, addresses = certificate.machine_names("0.0.0.0")
    assert dns[0] == "localhost" and addresses[:2] == ["127.0.0.1", "::1"]
    assert "0.0.0.0" not in addresses and not any(a.startswith("fe80") for a in addresses)
    assert "192.0.2.77" in certificate.machine_names("192.0.2.77")[1]


def _layout(tmp_path: Path) -> Layout:
    return Layout(Scope.USER, tmp_path / "units", tmp_path / "etc", tmp_path / "state")


def test_install_makes_the_certificate_once_and_again_before_it_runs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, lay = _config(tmp_path, "tls = true"), _layout(tmp_path)
    first = certificate.ensure(config, lay)
    assert first is not None and first.new and first.self_signed
    assert (lay.state_dir / "tls.key").stat().st_mode & 0o777 == 0o600
    again = certificate.ensure(config, lay)
    assert again is not None and not again.new and again.fingerprint == first.fingerprint
    short = certificate.make_self_signed(NAMES, days=certificate.RENEW_DAYS - 1)
    (lay.state_dir / "tls.crt").write_text(short[0])
    (lay.state_dir / "tls.key").write_text(short[1])
    renewed = certificate.ensure(config, lay)
    assert renewed is not None and renewed.new and renewed.fingerprint != first.fingerprint
    (lay.state_dir / "tls.key").write_text(certificate.make_self_signed(NAMES)[1])  # not its key
    assert certificate.ensure(config, lay).new  # type: ignore[union-attr]


def test_an_owners_certificate_that_does_not_load_is_refused_before_install_writes(
    tmp_path: Path, made: tuple[Path, Path]
) -> None:
    lay = _layout(tmp_path)
    other_key = tmp_path / "other.key"
    other_key.write_text(certificate.make_self_signed(NAMES)[1])
    for cert, key in [(made[0], other_key), (tmp_path / "none.pem", made[1])]:
        config = _config(tmp_path, f'tls = true\ntls_cert = "{cert}"\ntls_key = "{key}"')
        with pytest.raises(ApplianceError, match="cannot serve TLS") as e:
            certificate.check_given(config, lay)
        assert e.value.hint and "private key that belongs to it" in e.value.hint
    good = _config(tmp_path, f'tls = true\ntls_cert = "{made[0]}"\ntls_key = "{made[1]}"')
    certificate.check_given(good, lay)
    got = certificate.ensure(good, lay)
    assert got is not None and not got.self_signed and not got.new
    assert not (lay.state_dir / "tls.crt").exists()  # the owner's are used where they are


# --- one port, TLS and plain --------------------------------------------------------------------


class Echo(asyncio.Protocol):
    """A stand-in for uvicorn's protocol: answers each request line with what it saw."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.https = bool(transport.get_extra_info("sslcontext"))

    def data_received(self, data: bytes) -> None:
        body = (b"https " if self.https else b"http ") + b"x" * 300_000
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        self.transport.write(head + body)


def _serve_and_ask(run: Callable[[Any], Any], made: tuple[Path, Path]) -> list[str]:
    async def main() -> list[str]:
        cert = tls.Certificate(*made)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: tls.FirstByte(Echo, cert), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        trust = ssl.create_default_context(cafile=str(made[0]))
        seen = []
        for context in (trust, None, trust):
            reader_, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=context, server_hostname="localhost" if context else None
            )
            for _ in range(2):  # two requests on one connection: keep-alive
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await reader_.readuntil(b"\r\n\r\n")
                seen.append((await reader_.readexactly(300_005))[:5].decode().strip())
            writer.close()
        server.close()
        return seen

    return list(run(main()))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_one_port_speaks_tls_and_plain_http(loop: str, made: tuple[Path, Path]) -> None:
    run = asyncio.run if loop == "asyncio" else uvloop.run
    assert _serve_and_ask(run, made) == ["https"] * 2 + ["http"] * 2 + ["https"] * 2


def test_a_client_that_does_not_trust_the_certificate_gets_a_tls_error(
    made: tuple[Path, Path],
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        cert = tls.Certificate(*made)
        server = await loop.create_server(lambda: tls.FirstByte(Echo, cert), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.open_connection(
                "127.0.0.1", port, ssl=ssl.create_default_context(), server_hostname="localhost"
            )
        server.close()

    asyncio.run(main())


def test_a_renewed_certificate_is_served_to_new_connections(
    tmp_path: Path, made: tuple[Path, Path]
) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text(made[0].read_text())
    key.write_text(made[1].read_text())
    clock = [0.0]
    served = tls.Certificate(cert, key, clock=lambda: clock[0])
    first = served.fingerprint
    new_cert, new_key = certificate.make_self_signed(NAMES)
    key.write_text(new_key)
    cert.write_text(new_cert)
    assert served.now() is served.context and served.fingerprint == first  # not looked at yet
    clock[0] += tls.LOOK_S
    served.now()
    assert served.fingerprint == keys.fingerprint(new_cert) != first
    cert.write_text("broken")
    clock[0] += tls.LOOK_S
    before = served.context
    assert served.now() is before  # the last that loaded
    assert served.said is not None and "cannot load" in served.said


# --- the door -----------------------------------------------------------------------------------


def _scope(client: str, server: str = "10.0.0.1", scheme: str = "http", host: str = "") -> dict:
    headers = [(b"host", host.encode())] if host else []
    return {
        "scheme": scheme, "client": (client, 5000), "server": (server, 8000),
        "headers": headers,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("scope", "refused"),
    [
        (_scope("127.0.0.1"), False),
        (_scope("::1"), False),
        (_scope("10.0.0.1"), False),  # the machine's own address, to itself
        (_scope("10.0.0.7", scheme="https"), False),
        (_scope("10.0.0.7"), True),
        (_scope("fd00::7", server="fd00::1"), True),
        ({"scheme": "http", "client": None, "server": None, "headers": []}, True),
    ],
)
def test_plain_http_is_refused_from_afar_alone(
    made: tuple[Path, Path], scope: dict, refused: bool
) -> None:
    refusal = tls.InClear(tls.Certificate(*made))(scope)
    assert (refusal is not None) is refused


def test_the_refusal_says_where_to_go_and_what_to_trust(made: tuple[Path, Path]) -> None:
    cert = tls.Certificate(*made)
    refusal = tls.InClear(cert)(_scope("10.0.0.7", host="box.example:8000"))
    assert refusal is not None and refusal.status == 403 and refusal.code == "tls_required"
    assert "https://box.example:8000" in refusal.message and cert.fingerprint in refusal.message
    odd = tls.InClear(cert)(_scope("10.0.0.7", host="evil\r\nname"))
    assert odd is not None and "https://THIS-HOST:8000" in odd.message


def _tls_client(port: int, made: tuple[Path, Path], then: Callable[[ssl.SSLSocket], Any]) -> Any:
    """A blocking TLS client that completes its handshake, then does `then` (3 s at most)."""
    import socket

    trust = ssl.create_default_context(cafile=str(made[0]))
    raw = socket.create_connection(("127.0.0.1", port), timeout=3)
    with trust.wrap_socket(raw, server_hostname="localhost") as client:
        return then(client)


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app: answers each request with its scheme and a body too big for one write."""
    body = (b"https " if scope["scheme"] == "https" else b"http ") + b"x" * 300_000
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def _uvicorn(made: tuple[Path, Path]) -> AsyncIterator[int]:
    """A real uvicorn server given the door's protocol class as the proxy's worker gives it
    (appliance.proxy.mount.worker_settings): its port."""
    import socket

    settings = mount.worker_settings({"B70_TLS_CERT": str(made[0]), "B70_TLS_KEY": str(made[1])})
    config = uvicorn.Config(_answer, lifespan="off", log_level="warning", **settings)
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not serving.done(), serving
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await serving
        sock.close()


def _against_the_door(made: tuple[Path, Path], then: Callable[[ssl.SSLSocket], Any]) -> Any:
    async def main() -> Any:
        async with _uvicorn(made) as port:
            return await asyncio.to_thread(_tls_client, port, made, then)

    return asyncio.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_uvicorn_given_the_protocol_class_serves_tls_and_plain_on_one_port(
    loop: str, made: tuple[Path, Path]
) -> None:
    """The interface the proxy uses: uvicorn's Config(http=...) with tls.beside_plain, the
    requests' scheme as uvicorn's own protocol reads it, keep-alive both ways."""

    async def main() -> list[str]:
        seen = []
        async with _uvicorn(made) as port:
            trust = ssl.create_default_context(cafile=str(made[0]))
            for context in (trust, None, trust):
                reader_, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=context, server_hostname="localhost" if context else None
                )
                for _ in range(2):
                    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    head = (await reader_.readuntil(b"\r\n\r\n")).lower()
                    length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                    seen.append((await reader_.readexactly(length))[:5].decode().strip())
                writer.close()
        return seen

    run = asyncio.run if loop == "asyncio" else uvloop.run
    assert run(main()) == ["https"] * 2 + ["http"] * 2 + ["https"] * 2


def test_a_clients_close_notify_is_answered_with_the_doors(made: tuple[Path, Path]) -> None:
    """The client ends TLS (close_notify) and waits for the door's: `unwrap` returns once it
    comes, and times out (3 s) if it never does, as it did when the door read the client's
    close_notify as an empty chunk."""

    def ask_then_close(client: ssl.SSLSocket) -> bytes:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        seen = client.recv(5)
        while len(seen) < 300_000:  # the whole answer, so that only the close is left
            seen += client.recv(65536)
        client.unwrap()  # sends ours, then reads the door's
        return seen[:5]

    assert _against_the_door(made, ask_then_close) == b"HTTP/"


def test_a_client_that_completes_its_handshake_and_sends_nothing_is_closed(
    made: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handshake is no request: the door closes the connection after FIRST_BYTES_S, as it
    closes a plain connection that sends nothing (it stayed open past 75 s before)."""
    monkeypatch.setattr(tls, "FIRST_BYTES_S", 0.5)

    def wait(client: ssl.SSLSocket) -> bytes:
        try:
            return client.recv(1)  # b"": closed by the door; a TimeoutError after 3 s if held
        except (ssl.SSLError, ConnectionError):
            return b""  # closed by the door without a close_notify

    assert _against_the_door(made, wait) == b""


def test_a_tls12_clients_renegotiation_is_refused(made: tuple[Path, Path]) -> None:
    """openssl s_client over TLS 1.2, told to renegotiate ("R" on its input): the door refuses
    (OP_NO_RENEGOTIATION, appliance.keys.server_context), where OpenSSL would otherwise accept
    a client's renegotiation."""
    assert keys.server_context(*made).options & ssl.OP_NO_RENEGOTIATION

    def renegotiate(port: int) -> str:
        out = subprocess.run(
            ["openssl", "s_client", "-tls1_2", "-connect", f"127.0.0.1:{port}",
             "-CAfile", str(made[0]), "-servername", "localhost"],
            input="R\n", capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
        return out.stdout + out.stderr

    async def main() -> str:
        async with _uvicorn(made) as port:
            return await asyncio.to_thread(renegotiate, port)

    said = asyncio.run(main())
    assert "RENEGOTIATING" in said and "no renegotiation" in said.lower(), said[-2000:]


def test_the_proxys_process_refuses_what_it_cannot_serve_in_one_line(
    tmp_path: Path, made: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """b70-proxy, before gunicorn starts: a missing config, half of TLS, a certificate that does
    not load. One line each, exit status 2, no traceback."""
    yaml = tmp_path / "litellm.yaml"
    broken = tmp_path / "broken.pem"
    broken.write_text("not a certificate")
    cases = [
        ({}, ["--config", str(tmp_path / "none.yaml")], "is not a file: run `b70ctl install`"),
        ({"B70_TLS_CERT": str(made[0])}, ["--config", str(yaml)], "needs both B70_TLS_CERT"),
        ({"B70_TLS_CERT": str(broken), "B70_TLS_KEY": str(made[1])}, ["--config", str(yaml)],
         f"its certificate {broken} with key {made[1]} does not load"),
        ({}, ["--config", str(yaml), "--workers", "0"], "at least one worker"),
    ]  # fmt: skip
    yaml.write_text("model_list: []\n")
    for env, argv, says in cases:
        monkeypatch.delenv("B70_TLS_CERT", raising=False)
        monkeypatch.delenv("B70_TLS_KEY", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert mount.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("b70-proxy: ") and says in err and "Traceback" not in err, err
        assert err.count("\n") == 1
