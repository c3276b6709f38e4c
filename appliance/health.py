"""HTTP probes of the runtimes and the proxy, and who listens on a port.

The controller's own requests go to its loopback ports and are sent with the standard library's
http.client: importing httpx costs 175 ms of every b70ctl start on a 2-core machine, and each
httpx client builds an SSL context that a plain-HTTP request never uses (the monitor and the
runtime's health gate send one every interval).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

import psutil

from appliance import run
from appliance.errors import ApplianceError
from appliance.runtimes import GENERATED_METRICS, METRICS_PATH, metric_sum, parse_in_flight

PROXY_HEALTH_PATH = "/health/liveliness"  # /health would send a completion to every model


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


class NoAnswer(Exception):
    """The request got no HTTP answer; `timed_out` when the time ran out rather than failed."""

    def __init__(self, detail: str, timed_out: bool = False) -> None:
        super().__init__(detail)
        self.detail, self.timed_out = detail, timed_out


def request(
    method: str,
    url: str,
    timeout_s: float,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> Answer:
    """One request; `body`, when given, is sent as JSON. Raises NoAnswer."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NoAnswer(f"not an http:// address: {url!r}")
    connection_class: Any = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    connection = connection_class(parts.hostname, parts.port, timeout=timeout_s)
    send_headers = dict(headers or {})
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        send_headers["Content-Type"] = "application/json"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request(method, target, body=data, headers=send_headers)
        response = connection.getresponse()
        return Answer(response.status, response.read())
    except TimeoutError:
        raise NoAnswer(f"no answer within {timeout_s:g} s", timed_out=True) from None
    except ConnectionRefusedError:
        raise NoAnswer("connection refused") from None
    except (OSError, http.client.HTTPException) as e:
        raise NoAnswer(str(e) or type(e).__name__) from None
    finally:
        connection.close()


@dataclass(frozen=True)
class Probe:
    healthy: bool
    detail: str


def probe(url: str, timeout_s: float = 2.0) -> Probe:
    try:
        answer = request("GET", url, timeout_s)
    except NoAnswer as e:
        return Probe(False, e.detail)
    if answer.status == 200:
        return Probe(True, "ok")
    return Probe(False, f"HTTP {answer.status}")


def read_in_flight(base_url: str, timeout_s: float = 2.0) -> int | None:
    """Requests a runtime is running or queueing, from its /metrics; None if it cannot say."""
    return read_work(base_url, timeout_s)[0]


def read_work(base_url: str, timeout_s: float = 2.0) -> tuple[int | None, float | None]:
    """From a runtime's /metrics: requests in flight, and tokens generated since it started;
    each None where it cannot say."""
    try:
        answer = request("GET", base_url + METRICS_PATH, timeout_s)
    except NoAnswer:
        return None, None
    if answer.status != 200:
        return None, None
    return parse_in_flight(answer.text), metric_sum(answer.text, GENERATED_METRICS)


def health_url(base_url: str, engine: str) -> str:
    return base_url + (PROXY_HEALTH_PATH if engine == "litellm" else "/health")


@dataclass(frozen=True)
class Listener:
    pid: int | None
    command: str | None


def listeners(port: int) -> list[Listener]:
    """Processes listening on a TCP port (pid None: a socket of another user)."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            found.append(Listener(conn.pid, _command(conn.pid)))
    return found


def _command(pid: int | None) -> str | None:
    if pid is None:
        return None
    try:
        return " ".join(psutil.Process(pid).cmdline()) or psutil.Process(pid).name()
    except psutil.Error:
        return None


def foreign_listeners(port: int, main_pids: list[int]) -> list[Listener]:
    """Processes listening on `port` that are not in the process tree of any of `main_pids`."""
    ours: set[int] = set()
    for pid in main_pids:
        ours |= process_tree(pid)
    return [listener for listener in listeners(port) if listener.pid not in ours]


def describe(found: list[Listener]) -> str:
    parts = []
    for listener in found:
        if listener.pid is None:
            parts.append("a process of another user")
        else:
            parts.append(f"pid {listener.pid} ({(listener.command or '?')[:120]})")
    return ", ".join(parts)


def process_tree(pid: int) -> set[int]:
    try:
        root = psutil.Process(pid)
        return {pid} | {child.pid for child in root.children(recursive=True)}
    except psutil.Error:
        return set()


def container_pid(cli: str, name: str) -> int | None:
    out = run.ask([cli, "inspect", "--format", "{{.State.Pid}}", name], timeout_s=10)
    if out is None:
        return None
    text = out.stdout.strip()
    return int(text) if out.returncode == 0 and text.isdigit() and int(text) > 0 else None


def pid_alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def chat_completion(
    base_url: str,
    api_key: str,
    model: str,
    prompt: str,
    max_tokens: int = 8,
    timeout_s: float = 60,
    headers: dict[str, str] | None = None,
) -> str:
    """One greedy completion; returns the text or raises ApplianceError with what went wrong."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    try:
        answer = request(
            "POST",
            base_url + "/v1/chat/completions",
            timeout_s,
            body=body,
            headers={"Authorization": f"Bearer {api_key}", **(headers or {})},
        )
    except NoAnswer as e:
        raise ApplianceError(
            f"no completion from {base_url}: {e.detail}", code="verify_failed"
        ) from None
    if answer.status != 200:
        raise ApplianceError(
            f"completion through {base_url} answered HTTP {answer.status}: {answer.text[:300]}",
            code="verify_failed",
        )
    try:
        return str(answer.json()["choices"][0]["message"]["content"] or "")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ApplianceError(
            f"completion through {base_url} is not a chat completion: {answer.text[:300]}",
            code="verify_failed",
        ) from e
