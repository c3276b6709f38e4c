"""HTTP probes of the runtimes and the proxy, and who listens on a port.

The controller's own requests go to its loopback ports and are sent with the standard library's
http.client: httpx would add its import to every b70ctl start (docs/startup.md), and each httpx
client builds an SSL context that a plain-HTTP request never uses (the monitor and the runtime's
health guard send one every interval).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

from appliance.errors import ApplianceError
from appliance.host.runtime_http import (  # fmt: skip
    GENERATED_METRICS,
    HEALTH_PATH,
    METRICS_PATH,
    metric_sum,
    parse_in_flight,
)

PROXY_HEALTH_PATH = "/health/liveliness"  # /health would send a completion to every model


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: its status and body."""

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
    """A health probe: whether it passed, and what it saw."""

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
    return base_url + (PROXY_HEALTH_PATH if engine == "litellm" else HEALTH_PATH)


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
