"""The status page's door and the monitor's ring of samples, without a manager: the hosts it
answers, what is refused, what the key lets in, and how the ring stays an hour long; and the
proxy hold's token, compared as bytes like the page's secrets."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.config import is_loopback, parse
from appliance.errors import ConfigError
from appliance.layout import SAMPLES, Layout, Scope
from appliance.watch import samples, statuspage
from b70tools.net import free_port

KEY = "sk-b70-test-key"


def config_text(host: str, port: int, tls: str = "") -> str:
    return f"""
default_runtime = "a"
[runtimes.a]
engine = "llamacpp"
model = "/m.gguf"
[proxy]
{tls}
[monitor]
host = "{host}"
port = {port}
"""


IDLE_S = 2.0  # the page's idle limit here (10 s as the monitor serves it)
# The client side of the exposed page's TLS: its URL's trust (the page's certificate)
TRUST: dict[str, ssl.SSLContext] = {}


@pytest.fixture(params=["127.0.0.1", "0.0.0.0"], ids=["loopback", "exposed"])
def page(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, bool]]:
    """The page on loopback (plain HTTP, no key), or exposed: over TLS alone, with the proxy's
    certificate, as the monitor serves it."""
    from appliance.deploy.certificate import make_self_signed
    from appliance.watch.monitor import page_tls

    port = free_port()
    exposed = request.param != "127.0.0.1"
    cert, key = tmp_path / "page.crt", tmp_path / "page.key"
    pem, key_pem = make_self_signed((["localhost"], ["127.0.0.1", "::1"]))
    cert.write_text(pem)
    key.write_text(key_pem)
    tls = f'tls = true\ntls_cert = "{cert}"\ntls_key = "{key}"' if exposed else ""
    cfg = parse(config_text(request.param, port, tls), tmp_path / "appliance.toml")
    lay = Layout(Scope.USER, tmp_path / "units", tmp_path / "etc", tmp_path / "state")
    lay.etc_dir.mkdir()
    lay.state_dir.mkdir()
    lay.key_file.write_text(f"LITELLM_MASTER_KEY={KEY}\n")
    from prometheus_client import CollectorRegistry

    page = statuspage.Page(cfg, lay, CollectorRegistry())
    server = statuspage.serve(
        page,
        request.param,
        port,
        poll_s=0.005,
        tls=page_tls(cfg, lay) if exposed else None,
        idle_s=IDLE_S,
    )
    url = f"{'https' if exposed else 'http'}://127.0.0.1:{port}"
    TRUST[url] = ssl.create_default_context(cafile=str(cert))
    try:
        yield url, exposed
    finally:
        server.shutdown()
        server.server_close()


def _get(url: str, **options: Any) -> httpx.Response:
    return httpx.get(url, verify=_trust(url), **options)


def _client(url: str, **options: Any) -> httpx.Client:
    return httpx.Client(base_url=url, verify=_trust(url), **options)


def _trust(url: str) -> ssl.SSLContext | bool:
    base = url.split("/", 3)
    return TRUST.get("/".join(base[:3]), True)


def test_beyond_loopback_the_config_asks_for_tls(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"monitor\.host: 0\.0\.0\.0 is beyond loopback"):
        parse(config_text("0.0.0.0", 9999), tmp_path / "appliance.toml")


def test_the_page_is_shut_to_those_without_the_key_when_exposed(page: tuple[str, bool]) -> None:
    url, exposed = page
    first = _get(url + "/")
    if not exposed:
        assert first.status_code == 200 and 'name="b70-token"' in first.text
        assert first.headers["X-Content-Type-Options"] == "nosniff"
        return
    assert first.status_code == 401 and KEY not in first.text
    assert _get(url + "/metrics").status_code == 401
    assert _get(url + "/", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert _get(url + "/", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    login = _get(url + f"/?key={KEY}")
    assert login.status_code == 303 and login.headers["Location"] == "/"
    cookie = login.headers["Set-Cookie"]
    session = login.cookies[statuspage.COOKIE]
    assert KEY not in cookie and len(session) >= 40, "the cookie holds a session, not the key"
    for part in ("HttpOnly", "SameSite=Strict", "Secure", f"Max-Age={statuspage.SESSION_S}"):
        assert f"; {part}" in cookie, cookie
    with _client(url, cookies=login.cookies) as client:
        assert client.get("/status.js").status_code == 200
    forged = {statuspage.COOKIE: session[:-2] + "xx"}
    with _client(url, cookies=forged) as client:
        assert client.get("/api/state").status_code == 401
    with _client(url, cookies={"b70_key": KEY}) as client:  # the old cookie is no session
        assert client.get("/api/state").status_code == 401


def test_a_post_needs_the_pages_token_json_and_the_pages_origin(page: tuple[str, bool]) -> None:
    url, exposed = page
    auth = {"Authorization": f"Bearer {KEY}"} if exposed else {}
    http = _client(url)
    token = http.get(url + "/", headers=auth).text.split('content="', 2)[2].split('"', 1)[0]
    switch = url + "/api/switch"
    body = {"runtime": "a"}
    cases = [
        ({}, "token"),
        ({"X-B70-Token": token + "x"}, "token"),
        ({"X-B70-Token": token, "Origin": "http://evil.example"}, "evil.example"),
        ({"X-B70-Token": token, "Sec-Fetch-Site": "same-site"}, "another site"),
    ]
    for headers, why in cases:
        out = http.post(switch, json=body, headers={**auth, **headers})
        assert out.status_code == 403 and why in out.json()["error"]["message"], (headers, out.text)
    form = http.post(switch, data=body, headers={**auth, "X-B70-Token": token})
    assert form.status_code == 403 and "JSON" in form.json()["error"]["message"]
    unknown = http.post(switch, json={"runtime": "zz"}, headers={**auth, "X-B70-Token": token})
    assert unknown.status_code == 400 and "no runtime named 'zz'" in unknown.text
    bad = http.post(switch, content=b"[1", headers={**auth, "X-B70-Token": token,
                                                      "Content-Type": "application/json"})  # fmt: skip
    assert bad.status_code == 400
    assert http.get(url + "/nothing", headers=auth).status_code == 404
    http.close()


# --- the hosts the page answers -------------------------------------------------------------------


Headers = dict[str, str | bytes]


def ask(
    url: str,
    method: str,
    path: str,
    hosts: list[str],
    headers: Headers | None = None,
    body: bytes | None = None,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """A request with exactly these Host headers (none, one, two), as a browser or a rebinding
    site could send it; header values as bytes go on the wire as they are."""
    conn: http.client.HTTPConnection = (
        http.client.HTTPSConnection("127.0.0.1", port_of(url), timeout=10, context=TRUST[url])
        if url.startswith("https")
        else http.client.HTTPConnection("127.0.0.1", port_of(url), timeout=10)
    )
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for host in hosts:
            conn.putheader("Host", host)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        answer = conn.getresponse()
        return answer.status, answer.headers, answer.read()
    finally:
        conn.close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def token_of(url: str, exposed: bool) -> str:
    auth = {"Authorization": f"Bearer {KEY}"} if exposed else {}
    return _get(url + "/", headers=auth).text.split('name="b70-token" content="', 1)[1][:32]


def test_a_foreign_host_is_misdirected_on_every_route_before_anything_is_read(
    page: tuple[str, bool],
) -> None:
    """DNS rebinding: a site whose name now resolves to 127.0.0.1 is answered 421, whatever it
    asks and whatever it carries (the page's token, the key, its own origin)."""
    url, exposed = page
    token, port = token_of(url, exposed), port_of(url)
    foreign = f"attacker.example:{port}"
    auth: Headers = {"Authorization": f"Bearer {KEY}"} if exposed else {}
    for method, path in [("GET", "/"), ("GET", "/status.js"), ("GET", "/api/state"),
                         ("GET", "/metrics"), ("HEAD", "/"), ("GET", f"/?key={KEY}"),
                         ("GET", "/nothing")]:  # fmt: skip
        for headers in ({}, auth):
            status, answer, body = ask(url, method, path, [foreign], headers)
            assert status == 421, (method, path, headers, status, body)
            assert token.encode() not in body and KEY.encode() not in body
            assert b"b70-token" not in body
            assert "Set-Cookie" not in answer
    switch = {**auth, "Origin": f"http://{foreign}", "Sec-Fetch-Site": "same-origin",
              "X-B70-Token": token, "Content-Type": "application/json"}  # fmt: skip
    status, _, body = ask(url, "POST", "/api/switch", [foreign], switch, b'{"runtime": "zz"}')
    assert status == 421 and b"attacker.example" in body, (status, body)
    assert json.loads(body)["error"]["code"] == "Misdirected Request"


def test_only_loopback_names_and_the_pages_own_are_served(page: tuple[str, bool]) -> None:
    url, exposed = page
    port = port_of(url)
    auth: Headers = {"Authorization": f"Bearer {KEY}"} if exposed else {}
    served = [f"127.0.0.1:{port}", "127.0.0.1", f"127.8.9.10:{port}", f"localhost:{port}",
              f"LocalHost:{port}", "localhost", f"[::1]:{port}", f"[0:0::1]:{port}", "[::1]"]  # fmt: skip
    foreign = ["attacker.example", f"127.0.0.1.attacker.example:{port}", f"foo.localhost:{port}",
               f"localhost.attacker.example:{port}", f"localhost.:{port}", f"localhost:{port + 1}",
               f"127.0.0.1:{port + 1}", f"127.1:{port}", f"[::2]:{port}", f"::1:{port}",
               f"[::1:{port}", f"localhost:{port}:{port}", f"localhost:+{port}", "localhost:",
               f"localhost:{port}0", f"[::1]{port}", f"0.0.0.0:{port}", f"[::]:{port}", "",
               f"b\u00e4d.example:{port}", "localhost:\u00b2", "local host"]  # fmt: skip
    for host in served:
        status, _, body = ask(url, "GET", "/", [host], auth)
        assert status == 200 and b"b70-token" in body, (host, status, body)
    for host in foreign:
        status, _, body = ask(url, "GET", "/api/state", [host], auth)
        assert status == 421, (host, status, body)
    # The machine's own names and addresses: served when the page is exposed, not on loopback.
    own = [socket.gethostname(), *[a for a in own_addresses() if not is_loopback(a)][:2]]
    for name in own:
        if is_loopback(name):
            continue
        host = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
        status, _, body = ask(url, "GET", "/", [host], auth)
        assert status == (200 if exposed else 421), (host, status, body)


def own_addresses() -> list[str]:
    import psutil

    return [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)]  # fmt: skip


def test_a_request_names_its_host_once(page: tuple[str, bool]) -> None:
    url, exposed = page
    auth: Headers = {"Authorization": f"Bearer {KEY}"} if exposed else {}
    for hosts in ([], ["127.0.0.1", "127.0.0.1"], ["127.0.0.1", "attacker.example"]):
        status, _, body = ask(url, "GET", "/", hosts, auth)
        assert status == 400 and b"Host" in body and b"b70-token" not in body, (hosts, body)
    status, _, body = ask(url, "GET", "http://[x/", ["127.0.0.1"], auth)  # not a path
    assert status == 400 and b"not a path" in body, body


def test_a_switch_comes_from_the_origin_of_the_host_it_names(page: tuple[str, bool]) -> None:
    url, exposed = page
    token, port = token_of(url, exposed), port_of(url)
    auth: Headers = {"Authorization": f"Bearer {KEY}"} if exposed else {}
    post = {**auth, "X-B70-Token": token, "Content-Type": "application/json"}
    body = b'{"runtime": "zz"}'
    mine, other = ("https", "http") if exposed else ("http", "https")
    for host, origin in [(f"localhost:{port}", f"{mine}://localhost:{port}"),
                         (f"LOCALHOST:{port}", f"{mine}://localhost:{port}"),
                         ("localhost", f"{mine}://localhost"),
                         (f"[::1]:{port}", f"{mine}://[::1]:{port}"),
                         (f"127.0.0.1:{port}", None)]:  # fmt: skip
        headers = post if origin is None else {**post, "Origin": origin}
        status, _, out = ask(url, "POST", "/api/switch", [host], headers, body)
        assert status == 400 and b"no runtime named 'zz'" in out, (host, origin, status, out)
    for host, origin in [(f"localhost:{port}", f"{mine}://127.0.0.1:{port}"),
                         (f"localhost:{port}", f"{mine}://localhost"),
                         (f"localhost:{port}", f"{other}://localhost:{port}"),
                         (f"localhost:{port}", f"{mine}://localhost:{port}/"),
                         (f"localhost:{port}", f"{mine}://attacker.example:{port}"),
                         (f"localhost:{port}", "null"),
                         (f"localhost:{port}", f"{mine}://user@localhost:{port}")]:  # fmt: skip
        status, _, out = ask(url, "POST", "/api/switch", [host], {**post, "Origin": origin}, body)
        assert status == 403 and b"a request from" in out, (host, origin, status, out)


# --- secrets are compared as bytes: any text is a mismatch, never an error ------------------------


def test_a_key_cookie_or_token_of_any_text_is_refused_cleanly(page: tuple[str, bool]) -> None:
    url, exposed = page
    host = [f"127.0.0.1:{port_of(url)}"]
    others = ["é".encode(), b"\xff\xfe", "k\u20ac".encode()]
    if exposed:
        for wrong in others:
            status, answer, _ = ask(url, "GET", "/", host, {"Authorization": b"Bearer " + wrong})
            assert status == 401, (wrong, status)
        # A quoted cookie's octal escapes make any character of its value.
        for cookie in [
            'b70_session="\\351"',
            'b70_session="\\377\\376"',
            "b70_session=\u00e9",
            f"b70_session={'x' * 5000}",
            'b70_session="\\"; b70_session=;',
        ]:
            status, answer, _ = ask(url, "GET", "/", host, {"Cookie": cookie})
            assert status == 401 and "Set-Cookie" not in answer, (cookie, status)
        for query in ("%C3%A9", "%FF", "%ED%A0%80", "%E2%82%AC"):
            status, answer, _ = ask(url, "GET", f"/?key={query}", host)
            assert status == 401 and "Set-Cookie" not in answer, (query, status)
    auth: Headers = {"Authorization": f"Bearer {KEY}"} if exposed else {}
    for wrong in others:
        headers = {**auth, "X-B70-Token": wrong, "Content-Type": "application/json"}
        status, _, body = ask(url, "POST", "/api/switch", host, headers, b'{"runtime": "a"}')
        assert status == 403 and b"token" in body, (wrong, status, body)


def test_the_holds_token_of_any_text_is_a_mismatch(tmp_path: Path) -> None:
    """The proxy's turnstile compares a request's hold token with the switch's as bytes: a token in
    any text (a header is latin-1; JSON can carry a lone surrogate) is another switch's."""
    import asyncio

    from appliance import hold
    from appliance.proxy import waiting

    async def healthy() -> bool:
        return True

    turnstile = waiting.Turnstile(tmp_path, healthy, 1.0)
    with hold.marked(tmp_path, "b") as mark:
        for wrong in ("é", "\u00ff" * 32, "\ud800", mark.token + "\u20ac"):
            assert turnstile.admits(wrong, mark) is False
            assert asyncio.run(turnstile.blocked(wrong)) == "switching to b"
        assert turnstile.admits(mark.token, mark) is True
        assert asyncio.run(turnstile.blocked(mark.token)) is None


def test_the_ring_keeps_the_last_hour_and_drops_the_rest_in_one_rewrite(tmp_path: Path) -> None:
    t0 = 1_000_000.0
    for i in range(0, 4200, 10):  # 70 minutes, a sample every 10 s
        samples.append(tmp_path, {"t": t0 + i, "runtime": "a"}, now=t0 + i)
    kept = samples.read(tmp_path)
    now = t0 + 4190
    # Never more than an hour and the slack; the rewrite left the last hour.
    assert kept[0]["t"] >= now - samples.KEEP_S - samples.SLACK_S
    assert kept[-1]["t"] == now and len(kept) <= (samples.KEEP_S + samples.SLACK_S) / 10 + 1
    assert [s["t"] for s in samples.read(tmp_path, since=now - 25)] == [now - 20, now - 10, now]
    with (tmp_path / SAMPLES).open("a") as f:
        f.write('{"t": "broken"\n[]\n')
    samples.append(tmp_path, {"t": now + 10}, now=now + 10)
    assert samples.read(tmp_path)[-1]["t"] == now + 10
    assert all(isinstance(s["t"], float) for s in samples.read(tmp_path))
    assert json.loads((tmp_path / SAMPLES).read_text().splitlines()[-1])["t"] == now + 10


def test_a_sample_holds_each_runtime_side_by_side() -> None:
    from appliance.host.gpu import Snapshot
    from appliance.switch.plans import Observation

    chat = Observation(5.0, "chat", "active", "running", 7, True, "", False, 2, 100.0)
    vision = Observation(5.0, "vision", "active", "running", 8, False, "", False, 1, 40.0)
    sample = samples.sample_of([chat, vision], 0, Snapshot([], 0, []))
    assert sample["runtime"] == "chat" and sample["in_flight"] == 3
    assert sample["healthy"] is False  # one runtime serving side by side does not answer
    assert sample["runtimes"] == {
        "chat": {"state": "active", "healthy": True, "in_flight": 2, "generated": 100.0},
        "vision": {"state": "active", "healthy": False, "in_flight": 1, "generated": 40.0},
    }
    nothing = Observation(5.0, None, None, None, None, False, "no runtime", False)
    empty = samples.sample_of([nothing], 0, Snapshot([], 0, []))
    assert empty["runtimes"] == {} and empty["in_flight"] is None and empty["healthy"] is False


def test_an_idle_connection_is_closed_after_its_handshake_or_without_one(
    page: tuple[str, bool],
) -> None:
    """A client that connects and says nothing (no TLS handshake, or one and then nothing) is let
    go after IDLE_S, and holds no thread of the page's beyond that."""
    import time

    url, exposed = page
    idle = IDLE_S

    def closed_after(sock: socket.socket) -> float:
        started = time.monotonic()
        sock.settimeout(idle + 20)
        with contextlib.suppress(ConnectionResetError, ssl.SSLError):  # closed, either way
            assert sock.recv(1) == b""
        return time.monotonic() - started

    raw = socket.create_connection(("127.0.0.1", port_of(url)))
    took = closed_after(raw)
    raw.close()
    assert idle - 0.5 <= took <= idle + 3, took
    if exposed:
        tcp = socket.create_connection(("127.0.0.1", port_of(url)))
        tls = TRUST[url].wrap_socket(tcp, server_hostname="127.0.0.1")  # the handshake, done
        took = closed_after(tls)
        tls.close()
        assert idle - 0.5 <= took <= idle + 3, took
