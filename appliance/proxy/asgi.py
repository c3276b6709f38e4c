"""The ASGI shapes the proxy's modules pass around, the one way they write to the journal, and
the one way a key or token is compared.

Imported by the proxy: nothing from the rest of the controller.
"""

from __future__ import annotations

import hmac
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


def same_secret(given: str, secret: str) -> bool:
    """Whether `given` is `secret`, in constant time, for any text (compared as UTF-8 bytes; a
    lone surrogate too): a value that is not ASCII is a mismatch, not a TypeError."""
    return hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), secret.encode("utf-8", "surrogatepass")
    )
