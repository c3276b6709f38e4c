"""The model list, with the APIs each name speaks: LiteLLM's answer to GET /v1/models (and
/v1/models/NAME), to which the door adds, for each name the appliance's runtimes serve:

- `apis`: the APIs of the runtime that serves it now, when the door knows which (the engine the
  runtime on its port says it is, and one runtime of that engine takes turns there); else those
  that any of its runtimes speaks;
- `apis_by_runtime`: each runtime that may serve it, and the APIs it speaks
  (runtimes.NAME.apis, or read from the runtime's flags: appliance.apis);
- `serving_runtime`: the runtime that serves it now, when the door knows.

A peer's names, which the appliance's runtimes do not serve, are left as LiteLLM lists them.

Imported by the proxy: nothing from the rest of the controller but appliance.proxy's own.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from appliance import apis
from appliance.proxy import Message, Send

# name -> {runtime: {"engine": ..., "apis": [...]}}, as rendered into the deployments' model_info
RuntimesOf = Callable[[str], Mapping[str, Mapping[str, Any]] | None]
# name -> the serving runtime's engine as appliance.proxy.backend.Facts names it, if known
EngineOf = Callable[[str], Awaitable[str | None]]
MAX_LIST_BYTES = 1 << 20


def describe(runtimes: Mapping[str, Mapping[str, Any]], engine: str | None) -> dict[str, Any]:
    """What /v1/models adds to a name served by `runtimes`, its runtime's engine now `engine`."""
    by_runtime = {rt: [a for a in info.get("apis", ()) if a in apis.ALL]
                  for rt, info in sorted(runtimes.items())}  # fmt: skip
    now = [rt for rt, info in runtimes.items()
           if apis.ENGINE_NAMES.get(info.get("engine", "")) == engine]  # fmt: skip
    added: dict[str, Any] = {}
    if engine is not None and len(now) == 1:
        added["apis"] = by_runtime[now[0]]
        added["serving_runtime"] = now[0]
    else:
        added["apis"] = [a for a in apis.ALL if any(a in v for v in by_runtime.values())]
    added["apis_by_runtime"] = by_runtime
    return added


class ModelsAnswer:
    """A `send` that adds the APIs to LiteLLM's model list (or one model) on its way out."""

    def __init__(self, send: Send, runtimes_of: RuntimesOf, engine_of: EngineOf) -> None:
        self.send = send
        self.runtimes_of = runtimes_of
        self.engine_of = engine_of
        self.start: Message | None = None
        self.body: list[bytes] = []
        self.size = 0
        self.passing = False

    async def __call__(self, message: Message) -> None:
        if self.passing:
            await self.send(message)
        elif message["type"] == "http.response.start":
            if message.get("status") != 200:
                self.passing = True
                await self.send(message)
            else:
                self.start = message
        elif message["type"] == "http.response.body" and self.start is not None:
            self.body.append(message.get("body", b""))
            self.size += len(self.body[-1])
            if self.size > MAX_LIST_BYTES:  # not a list this door rendered: as it is
                await self._release(b"".join(self.body), more=message.get("more_body", False))
            elif not message.get("more_body", False):
                await self._release(await self._added(b"".join(self.body)), more=False)
        else:
            await self.send(message)

    async def _release(self, body: bytes, more: bool) -> None:
        assert self.start is not None
        self.passing = True
        headers = [(k, v) for k, v in self.start.get("headers", ()) if k != b"content-length"]
        if not more:
            headers.append((b"content-length", b"%d" % len(body)))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": more})

    async def _added(self, body: bytes) -> bytes:
        try:
            data = json.loads(body)
        except ValueError:
            return body
        entries = data.get("data") if isinstance(data, dict) and "data" in data else [data]
        if not isinstance(entries, list):
            return body
        for entry in entries:
            name = entry.get("id") if isinstance(entry, dict) else None
            if not isinstance(name, str):
                continue
            runtimes = self.runtimes_of(name)
            if runtimes:
                entry.update(describe(runtimes, await self.engine_of(name)))
        return json.dumps(data).encode()
