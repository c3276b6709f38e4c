"""The status page: served by the monitor on its port, beside /metrics, with no database.

Routes:
  GET  /                 the page (templates/status.html), with this process's switch token
  GET  /status.js        its script
  GET  /api/state?since=T  what the page shows: units and cards, the samples after T (the
                         monitor's ring, appliance.watch.samples), the switch history, the
                         switch the page started and its phases so far, requests held, the
                         journal's tail
  POST /api/switch       {"runtime": NAME}: runs `b70ctl switch NAME`; one at a time
  GET  /metrics          Prometheus text (appliance.watch.metrics)

A request must name in its one Host header a host the page is served as (Page.serves), with the
page's port or none; any other gets 421 before anything is read, so a site whose name was rebound
to this machine (DNS rebinding) gets nothing. On loopback (the default) anyone on the box may
look, over plain HTTP; beyond it, the page speaks TLS alone, with the proxy's certificate ([proxy]
tls, which the config then asks for), and every route wants the appliance key: `Authorization:
Bearer KEY`, or a session of the page's own, which `GET /?key=KEY` opens. Its cookie holds a
random id, never the key (HttpOnly, SameSite=Strict, Secure, and it ends after SESSION_S, or when
the monitor restarts). A POST must also carry the page's token in X-B70-Token, as JSON, from the
page's origin (Sec-Fetch-Site; Origin: the page's scheme and the request's Host): another site
can neither read the token nor send the header without a preflight this server never grants.
Secrets are compared as bytes: any text is only a mismatch. A connection that says nothing for
IDLE_S is closed, a TLS handshake included.
"""

from __future__ import annotations

import functools
import hashlib
import http.cookies
import ipaddress
import json
import secrets
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from appliance import hold
from appliance.config import Config, is_loopback
from appliance.config.values import WILDCARD_HOSTS, check_host
from appliance.errors import ApplianceError
from appliance.keys import same_secret
from appliance.layout import Layout, Scope
from appliance.switch.demand.queues import demand_view
from appliance.switch.records import read_history
from appliance.units import systemd
from appliance.usage import read_usage
from appliance.watch import samples, status

ASSETS = {"/": ("status.html", "text/html; charset=utf-8"),
          "/status.js": ("status.js", "text/javascript; charset=utf-8")}  # fmt: skip
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
COOKIE = "b70_session"
SESSION_S = 12 * 3600  # a session of the page's lasts this long
MOST_SESSIONS = 256  # the oldest goes when one more opens
IDLE_S = 10.0  # a connection that sends nothing this long is closed
HISTORY_SHOWN = 20
JOURNAL_LINES = 15
MAX_BODY = 4096


def parse_authority(text: str) -> tuple[str, int | None] | None:
    """A Host header's (or an origin's) name and port, from `name`, `name:port`, `[v6]` or
    `[v6]:port`; None when it is none of them. The name in lower case, an IPv6 address bare and
    compressed; the port None when none is given."""
    if text.startswith("["):
        inner, bracket, rest = text[1:].partition("]")
        name = parse_host_name(inner) if bracket and ":" in inner else ""
    else:
        name, colon, port_text = text.partition(":")
        name, rest = name.lower(), colon + port_text
    if not name or check_host(name) is not None:  # a host name or an IP address, IPv6 too
        return None
    if not rest:
        return name, None
    digits = rest[1:]
    ok = rest[0] == ":" and digits.isascii() and digits.isdigit() and len(digits) <= 5
    return (name, int(digits)) if ok and int(digits) <= 65535 else None


def parse_host_name(host: str) -> str:
    """A configured host as parse_authority gives its name: lower case, IPv6 compressed."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower()


def is_loopback_address(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@functools.cache
def machine_names() -> frozenset[str]:
    """This machine's host name and fully qualified name (read once: the FQDN may ask DNS)."""
    return frozenset({socket.gethostname().lower(), socket.getfqdn().lower()})


def machine_addresses() -> frozenset[str]:
    """The addresses of this machine's interfaces now, as parse_authority gives them."""
    import psutil

    ip = (socket.AF_INET, socket.AF_INET6)
    every = [a for addresses in psutil.net_if_addrs().values() for a in addresses]
    return frozenset(parse_host_name(a.address.split("%")[0]) for a in every if a.family in ip)


@dataclass
class Job:
    """A switch the page started: its phases as b70ctl prints them, then how it ended."""

    target: str
    started: float
    lines: list[str] = field(default_factory=list)
    done: bool = False
    ok: bool | None = None
    error: str | None = None


class Page:
    def __init__(self, config: Config, lay: Layout, metrics: Any) -> None:
        self.config, self.lay, self.metrics = config, lay, metrics
        self.token = secrets.token_urlsafe(24)
        self.exposed = not is_loopback(config.monitor.host)
        host = config.monitor.host
        self.host_name = None if host in WILDCARD_HOSTS else parse_host_name(host)
        self.job: Job | None = None
        self.lock = threading.Lock()
        self.tls = False  # served over TLS (serve() sets it)
        # The open sessions: the SHA-256 of each id, and when it ends (time.monotonic())
        self.sessions: dict[bytes, float] = {}

    def open_session(self) -> str:
        """A new session's id (its cookie's value); the oldest goes beyond MOST_SESSIONS."""
        session = secrets.token_urlsafe(32)
        with self.lock:
            now = time.monotonic()
            self.sessions = {k: t for k, t in self.sessions.items() if t > now}
            while len(self.sessions) >= MOST_SESSIONS:
                del self.sessions[min(self.sessions, key=self.sessions.__getitem__)]
            self.sessions[hashlib.sha256(session.encode()).digest()] = now + SESSION_S
        return session

    def in_session(self, session: str) -> bool:
        if not session or len(session) > 64 or not session.isascii():
            return False
        digest = hashlib.sha256(session.encode()).digest()
        with self.lock:
            return self.sessions.get(digest, 0.0) > time.monotonic()

    def key(self) -> str:
        from appliance.keys import read_key

        return read_key(self.lay)

    def serves(self, name: str) -> bool:
        """Whether the page answers for the host `name` (as parse_authority gives it). Names
        other than localhost are resolved by DNS, which a site rebinds for its own names: only
        those this machine has are served (docs/security.md)."""
        if name == "localhost" or is_loopback_address(name) or name == self.host_name:
            return True
        return self.exposed and (name in machine_names() or name in machine_addresses())

    def judge_host(self, values: list[str], port: int) -> tuple[HTTPStatus, str] | None:
        """Why a request with these Host headers is not for this page, or None when it is."""
        if len(values) != 1:
            return HTTPStatus.BAD_REQUEST, "name the page's host in one Host header"
        host = parse_authority(values[0])
        if host is not None and host[1] in (None, port) and self.serves(host[0]):
            return None
        where = "by this machine's name or address" if self.exposed else "as localhost"
        return HTTPStatus.MISDIRECTED_REQUEST, (
            f"this page is not served as {values[0][:100]!r}: open it {where} "
            f"or as http://127.0.0.1:{port}/ on this machine"
        )

    # --- what the page shows ------------------------------------------------------------------

    def view(self, since: float | None) -> dict[str, Any]:
        """What the page shows (GET /api/state): the samples after `since`, and the rest now."""
        cards = status.cards_view(self.config)
        units = []
        with systemd.connect(self.lay.scope) as sd:
            for name, rt in sorted(self.config.runtimes.items()):
                st = sd.properties(rt.unit)
                units.append({"runtime": name, "unit": rt.unit, "engine": rt.engine.value,
                              "active": st.active_state, "sub": st.sub_state,
                              "cards": cards.get(rt.unit), "apis": list(rt.apis)})  # fmt: skip
        serving = [str(u["unit"]) for u in units if u["active"] == "active"]
        journal = None
        if serving:
            journal = systemd.journal_excerpt(self.lay.scope, serving[0], JOURNAL_LINES)
        counts = hold.read_counts(self.lay.state_dir)
        history = read_history(self.lay.state_dir)
        with self.lock:
            job = asdict(self.job) if self.job else None
        return {
            "now": time.time(),
            "model": self.config.proxy.model,
            "units": units,
            "samples": samples.read(self.lay.state_dir, since),
            "switches": history[-HISTORY_SHOWN:],
            "demand": demand_view(
                self.config, self.lay.state_dir, history[-1] if history else None
            ),
            "switching_to": (m.target if (m := hold.read_mark(self.lay.state_dir)) else None),
            "held_now": counts.now,
            "held_total": counts.total,
            "keys": [  # who used what in the last hour, by key name (never a secret)
                {"key": name, **use.as_line()}
                for name, use in sorted(read_usage(self.lay.state_dir, time.time() - 3600).items())
            ],
            "job": job,
            "journal": journal,
        }

    # --- the switch button --------------------------------------------------------------------

    def start_switch(self, name: str) -> Job:
        self.config.runtime(name)  # a ConfigError names the runtimes there are
        with self.lock:
            if self.job is not None and not self.job.done:
                raise ApplianceError(
                    f"a switch to {self.job.target} is running", code="switch_running"
                )
            argv = [self.config.b70ctl] + (["--user"] if self.lay.scope is Scope.USER else [])
            argv += ["--config", str(self.config.path), "switch", name]
            child = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            job = self.job = Job(name, time.time())
        threading.Thread(target=self._follow, args=(job, child), daemon=True).start()
        return job

    def _follow(self, job: Job, child: subprocess.Popen[str]) -> None:
        assert child.stderr is not None
        errors = []
        for line in child.stderr:
            line = line.rstrip("\n")
            with self.lock:
                job.lines.append(line)
            if line.startswith(("error: ", "hint: ")):
                errors.append(line)
        code = child.wait()
        with self.lock:
            job.done, job.ok = True, code == 0
            job.error = "\n".join(errors) or (None if code == 0 else f"b70ctl exited {code}")


@functools.cache
def asset(name: str) -> bytes:
    """A file of the page, read once (they ship in the package and do not change)."""
    from appliance.units.rendered import TEMPLATES

    return (TEMPLATES / name).read_bytes()


class Handler(BaseHTTPRequestHandler):
    page: Page  # set on the class serve() makes
    port: int  # the port it listens on, set there too
    server_version = "b70-monitor"

    def log_message(self, format: str, *args: Any) -> None:
        return  # no line per request in the journal

    def send(self, code: int, body: bytes, kind: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for key, value in {**HEADERS, "Content-Type": kind, **(extra or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_json(self, code: int, doc: Any) -> None:
        self.send(code, json.dumps(doc).encode(), "application/json")

    def refuse(self, code: HTTPStatus, message: str) -> None:
        self.send_json(code, {"error": {"code": code.phrase, "message": message}})

    def misdirected(self) -> bool:
        """Refuses a request that does not name one of the page's hosts (DNS rebinding): True
        when it did. Asked first: nothing is read for such a request."""
        problem = self.page.judge_host(self.headers.get_all("Host") or [], self.port)
        if problem is not None:
            self.refuse(*problem)
        return problem is not None

    def allowed(self, query: dict[str, list[str]]) -> bool:
        """Beyond loopback: the key by header, or a session the key opened once in the query."""
        if not self.page.exposed:
            return True
        key = self.page.key()
        given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        try:
            jar = http.cookies.SimpleCookie(self.headers.get("Cookie", ""))
        except http.cookies.CookieError:
            jar = http.cookies.SimpleCookie()
        session = jar[COOKIE].value if COOKIE in jar else ""
        if (given and same_secret(given, key)) or self.page.in_session(session):
            return True
        if self.path.startswith("/?") and same_secret(query.get("key", [""])[0], key):
            secure = "; Secure" if self.page.tls else ""
            cookie_line = (
                f"{COOKIE}={self.page.open_session()}; HttpOnly; SameSite=Strict{secure}; "
                f"Max-Age={SESSION_S}; Path=/"
            )
            self.send(HTTPStatus.SEE_OTHER, b"", "text/plain",
                      {"Location": "/", "Set-Cookie": cookie_line})  # fmt: skip
            return False
        self.refuse(HTTPStatus.UNAUTHORIZED, "the status page wants the appliance key")
        return False

    def do_GET(self) -> None:
        self.answer(self.get)

    do_HEAD = do_GET

    def do_POST(self) -> None:
        self.answer(self.post)

    def answer(self, respond: Callable[[str, dict[str, list[str]]], None]) -> None:
        """Every request's way: its Host judged first, then the key, then `respond`."""
        if self.misdirected():
            return
        try:
            url = urllib.parse.urlsplit(self.path)
        except ValueError:
            return self.refuse(HTTPStatus.BAD_REQUEST, f"not a path: {self.path[:100]!r}")
        query = urllib.parse.parse_qs(url.query) if self.command != "POST" else {}
        try:
            if self.allowed(query):
                respond(url.path, query)
        except (ApplianceError, OSError) as e:
            self.refuse(HTTPStatus.SERVICE_UNAVAILABLE, getattr(e, "message", str(e)))

    def get(self, path: str, query: dict[str, list[str]]) -> None:
        if path in ASSETS:
            name, kind = ASSETS[path]
            body = asset(name).replace(b"{{ token }}", self.page.token.encode())
            self.send(HTTPStatus.OK, body, kind)
        elif path == "/api/state":
            try:
                since = float(query["since"][0]) if "since" in query else None
            except ValueError:
                return self.refuse(HTTPStatus.BAD_REQUEST, "since: not a number")
            self.send_json(HTTPStatus.OK, self.page.view(since))
        elif path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            self.send(HTTPStatus.OK, generate_latest(self.page.metrics), CONTENT_TYPE_LATEST)
        else:
            self.refuse(HTTPStatus.NOT_FOUND, f"no page at {path}")

    def post(self, path: str, query: dict[str, list[str]]) -> None:
        if path != "/api/switch":
            return self.refuse(HTTPStatus.NOT_FOUND, f"nothing to post at {path}")
        if problem := self.cross_site():
            return self.refuse(HTTPStatus.FORBIDDEN, problem)
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                raise ValueError("length")
            body = json.loads(self.rfile.read(length))
            name = body["runtime"]
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            return self.refuse(HTTPStatus.BAD_REQUEST, 'send {"runtime": NAME} as JSON')
        try:
            job = self.page.start_switch(name)
        except ApplianceError as e:
            conflict = e.code == "switch_running"
            code = HTTPStatus.CONFLICT if conflict else HTTPStatus.BAD_REQUEST
            return self.refuse(code, e.message)
        self.send_json(HTTPStatus.ACCEPTED, asdict(job))

    def cross_site(self) -> str | None:
        """Why this POST may have come from another site; None when it is the page's own."""
        token = self.headers.get("X-B70-Token", "")
        if not same_secret(token, self.page.token):
            return "the page's token is missing or wrong: reload the page"
        if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
            return "send JSON"
        site = self.headers.get("Sec-Fetch-Site")
        if site is not None and site not in ("same-origin", "none"):
            return f"a request from another site ({site})"
        origin = self.headers.get("Origin")
        scheme = "https" if self.page.tls else "http"
        if origin is not None and not judge_origin(origin, self.headers.get("Host", ""), scheme):
            return f"a request from {origin}"
        return None


def judge_origin(origin: str, host: str, scheme: str = "http") -> bool:
    """Whether a browser's Origin is the page's own: its scheme and the request's Host (its name
    and port, as parse_authority reads them; the Host was judged before)."""
    authority = origin.removeprefix(f"{scheme}://")
    if authority == origin:
        return False  # another scheme, or "null"
    mine, theirs = parse_authority(host), parse_authority(authority)
    return mine is not None and mine == theirs


def serve(
    page: Page, host: str, port: int, poll_s: float = 0.1, tls: ssl.SSLContext | None = None,
    idle_s: float = IDLE_S,
) -> ThreadingHTTPServer:  # fmt: skip
    """The page's server, answering from a thread of its own, over TLS with `tls`. `poll_s`:
    how often its thread looks whether it is asked to stop (shutdown() waits up to that long);
    `idle_s`: how long a connection may say nothing."""

    class PageHandler(Handler):
        timeout = idle_s  # each connection's socket: a client that says nothing is let go

        def setup(self) -> None:
            super().setup()
            if tls is not None:  # the handshake in the connection's own thread, in IDLE_S
                self.request.do_handshake()

    PageHandler.page = page
    page.tls = tls is not None

    def get_request(self: ThreadingHTTPServer) -> tuple[socket.socket, Any]:
        raw, address = socket.socket.accept(self.socket)
        if tls is None:
            return raw, address
        return tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False), address

    server_class = type(
        "PageServer",
        (ThreadingHTTPServer,),
        {
            "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET,
            "get_request": get_request,
            # A client that left, or failed its handshake: nothing to say in the journal
            "handle_error": lambda self, request, address: None,
        },
    )
    server: ThreadingHTTPServer = server_class((host, port), PageHandler)
    PageHandler.port = server.server_port
    server.daemon_threads = True
    threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": poll_s},
        name="status-page",
        daemon=True,
    ).start()
    return server
