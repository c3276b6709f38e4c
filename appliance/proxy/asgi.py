"""The ASGI shapes the proxy's modules pass around, and the one way they write to the journal."""

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
