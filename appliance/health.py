"""HTTP probes of the runtimes and the proxy, and who listens on a port."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import psutil

from appliance import run
from appliance.errors import ApplianceError
from appliance.runtimes import METRICS_PATH, parse_in_flight

PROXY_HEALTH_PATH = "/health/liveliness"  # /health would send a completion to every model


@dataclass(frozen=True)
class Probe:
    healthy: bool
    detail: str


def probe(url: str, timeout_s: float = 2.0) -> Probe:
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.TimeoutException:
        return Probe(False, f"no answer within {timeout_s:g} s")
    except httpx.HTTPError as e:
        return Probe(False, _connect_error(e))
    if response.status_code == 200:
        return Probe(True, "ok")
    return Probe(False, f"HTTP {response.status_code}")


def read_in_flight(base_url: str, timeout_s: float = 2.0) -> int | None:
    """Requests a runtime is running or queueing, from its /metrics; None if it cannot say."""
    try:
        response = httpx.get(base_url + METRICS_PATH, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse_in_flight(response.text) if response.status_code == 200 else None


def health_url(base_url: str, engine: str) -> str:
    return base_url + (PROXY_HEALTH_PATH if engine == "litellm" else "/health")


def _connect_error(e: httpx.HTTPError) -> str:
    text = str(e) or type(e).__name__
    if "refused" in text.lower():
        return "connection refused"
    return text


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
        response = httpx.post(
            base_url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {api_key}", **(headers or {})},
            timeout=timeout_s,
        )
    except httpx.HTTPError as e:
        raise ApplianceError(
            f"no completion from {base_url}: {_connect_error(e)}", code="verify_failed"
        ) from e
    if response.status_code != 200:
        raise ApplianceError(
            f"completion through {base_url} answered HTTP {response.status_code}: "
            f"{response.text[:300]}",
            code="verify_failed",
        )
    try:
        return str(response.json()["choices"][0]["message"]["content"] or "")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ApplianceError(
            f"completion through {base_url} is not a chat completion: {response.text[:300]}",
            code="verify_failed",
        ) from e
