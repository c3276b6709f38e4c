"""The door's answers on the routes of appliance.proxy.apis when the runtime did not answer the
request itself: a runtime's error, in the API's own shape and naming the runtime, and a 501 for
an API the serving runtime does not serve, naming what it would need.

Imported by the proxy: nothing from the rest of the controller but appliance.proxy's own.
"""

from __future__ import annotations

import json
from typing import Any

from appliance import apis
from appliance.proxy.apis import BY_KIND
from appliance.proxy.checks import Refusal

# The engine names of appliance.proxy.backend.Facts, as the config names the engines.
ENGINES = {name: engine for engine, name in apis.ENGINE_NAMES.items()}
# A runtime without the route, or started without it (a 404 that names a model is not one: the
# runtime has the route and does not know the model asked for)
NOT_SERVED = (404, 405, 501)
MAX_SAID = 600  # characters of the runtime's own words kept in an answer


def runtime_error(kind: str, status: int, body: bytes, engine: str | None) -> Refusal:
    """A runtime's error answer to a request of `kind`, as the door answers it; `engine`: the
    serving runtime's, as appliance.proxy.backend.Facts names it (None when not known)."""
    said, their_kind, their_code = _said(body)
    who = f"the runtime ({engine})" if engine else "the runtime"
    if status == 404 and "model" in said.lower():  # a model it does not know: a 404 it stays
        return Refusal(
            404, f"{who} refused the request: {said}", their_code or "model_not_found",
            kind=their_kind or "invalid_request_error",
        )  # fmt: skip
    if status in NOT_SERVED:
        return not_served(kind, engine, said)
    if not 400 <= status <= 599:
        status = 502
    kind_of = their_kind or ("invalid_request_error" if status < 500 else "api_error")
    return Refusal(
        status, f"{who} refused the request: {said or f'status {status}'}",
        their_code or "b70_runtime_error", kind=kind_of,
    )  # fmt: skip


def not_served(kind: str, engine: str | None, said: str = "") -> Refusal:
    """501: the serving runtime does not serve the API of `kind`."""
    api = BY_KIND[kind].api
    who = f"the runtime that serves this model now ({engine})" if engine else "the runtime"
    message = f"{who} does not serve {api}"
    config_engine = ENGINES.get(engine or "")
    if config_engine is not None:
        message += f": {engine} serves {api} only when {apis.needs(config_engine, api)}"
    if said:
        message += f" (it said: {said})"
    return Refusal(501, message, "b70_api_not_served", kind="not_implemented")


def _said(body: bytes) -> tuple[str, str | None, str | None]:
    """The message of a runtime's error answer, and its type and code when it gives them."""
    try:
        data: Any = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:MAX_SAID], None, None
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        message = error.get("message") or error.get("detail") or json.dumps(error)
        kind, code = error.get("type"), error.get("code")
        return (
            str(message)[:MAX_SAID],
            kind if isinstance(kind, str) else None,
            code if isinstance(code, str) else None,
        )
    return str(error)[:MAX_SAID], None, None
