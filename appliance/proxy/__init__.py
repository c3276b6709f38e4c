"""The front door on :8000, inside LiteLLM's proxy process: the door and its chain of checks,
the key among them (`door`, `chain`, `checks`), the hold during a switch (`waiting`, `hook`),
the fast way to the runtime (`direct`) and the resend of a request whose runtime died before
its first byte (`relay`), LiteLLM's routing across runtimes and peers (`routing`), how all of
it is mounted in front of LiteLLM's app (`mount`), the APIs beside chat and completions:
Responses, Anthropic Messages, embeddings, rerank, tokenize (`apis`), and what the proxy's
workers share: fair turns, limits, usage, the fleet, TLS (`share`).

May import: the core modules alone (appliance.hold above all: the hold mark a switch writes and
the counts the proxy writes back). Nothing outside this package imports it: LiteLLM loads it by
name from the rendered config.

Here too: the ASGI shapes the proxy's modules pass around, and the one way they write to the
journal (`log`).
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Any, Receive, Send], Awaitable[None]]


def log(line: str) -> None:
    """One line to the proxy's journal (stderr)."""
    print(line, file=sys.stderr, flush=True)
