"""What the serving runtime says about itself, for the door's checks (appliance.proxy.checks):
its engine, its context and the model it serves, asked once and kept; and how many tokens a
prompt is, counted by the runtime's own tokenizer.

Imported by the proxy: nothing from the rest of the controller.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

FACTS_TTL_S = 10.0  # a kept context is renewed in the background after this
FRESH_S = 1.0  # ... and asked again before a refusal, unless it is this recent
# A runtime that was down or loading is asked again after FRESH_S; one that answered without
# saying (another kind of server) will not say more a second later: after FACTS_TTL_S.
BACKEND_TIMEOUT_S = 5.0
TEMPLATE_SLACK = 512  # tokens a chat template may add beyond the bytes of the body
MAX_COUNTED_PROMPTS = 8  # long prompts of one completion request the runtime is asked to count
CHAT, COMPLETION = "chat", "completion"


@dataclass(frozen=True)
class Facts:
    engine: str  # "vLLM" or "llama.cpp": the name clients see in errors
    context: int  # tokens one request may use, prompt and answer together
    model: str  # the name the runtime serves
    slots: int | None = None  # requests it runs at once, when it says (llama.cpp's /props)


def client_for(url: str, **options: Any) -> httpx.AsyncClient:
    """An HTTP client for one of the appliance's own addresses (a runtime on loopback, a peer's
    proxy), which are http:// (the config takes no other). Such a client is built without a TLS
    context: httpx builds one for every client it makes, loading its CA bundle on the worker's
    event loop, where every request waits for it. An https:// address keeps httpx's verified
    TLS."""
    plain = url.startswith("http://")
    return httpx.AsyncClient(verify=not plain, **options)


class Backend:
    """The serving runtime, asked over HTTP: its context, its engine, and token counts."""

    def __init__(
        self,
        url: str,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.clock = clock
        self.transport = transport
        self.known: Facts | None = None
        self.known_at = -math.inf
        self.retry_s = FRESH_S  # when an unknown answer is asked again
        self._client: httpx.AsyncClient | None = None
        self._asking: asyncio.Task[Facts | None] | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # created inside the proxy's event loop
            # A new connection for each question: a kept one may be closed by the runtime
            # just as it is used, and a loopback connect costs nothing.
            no_reuse = httpx.Limits(max_keepalive_connections=0)
            self._client = client_for(
                self.url, base_url=self.url, timeout=BACKEND_TIMEOUT_S, transport=self.transport,
                limits=no_reuse,
            )  # fmt: skip
        return self._client

    async def facts(self, fresh: bool = False) -> Facts | None:
        """What the runtime said, kept; `fresh`: asked again unless the answer is FRESH_S old.

        A runtime that could not say is asked again beside the requests: after FRESH_S if it
        was down or loading, after FACTS_TTL_S if it answered without saying (a server that
        does not answer these questions). The requests go on without its facts meanwhile, as
        when it cannot count a prompt, rather than each waiting for the question."""
        age = self.clock() - self.known_at
        if self.known is not None and not (fresh and age > FRESH_S):
            if age > FACTS_TTL_S:
                self._ask()  # renewed in the background; this request goes on with what is known
            return self.known
        if self.known is None and age <= FACTS_TTL_S and not fresh:
            if age > self.retry_s:
                self._ask()
            return None
        return await asyncio.shield(self._ask())

    def _ask(self) -> asyncio.Task[Facts | None]:
        if self._asking is None or self._asking.done():  # one question at a time per worker
            self._asking = asyncio.ensure_future(self._read_facts())
        return self._asking

    async def _read_facts(self) -> Facts | None:
        retry_s = FACTS_TTL_S
        try:
            facts = await self._query_facts()
        except (httpx.TransportError, httpx.HTTPStatusError) as e:  # down, or not ready
            facts = None
            unready = isinstance(e, httpx.TransportError) or e.response.status_code >= 500
            retry_s = FRESH_S if unready else FACTS_TTL_S
        except Exception:  # whatever answers on the port, a request never fails because of it
            facts = None
        self.known, self.known_at, self.retry_s = facts, self.clock(), retry_s
        return facts

    async def _query_facts(self) -> Facts | None:
        response = await self.client.get("/v1/models")
        response.raise_for_status()
        served = response.json()["data"][0]
        if "max_model_len" in served:
            return Facts("vLLM", int(served["max_model_len"]), str(served["id"]))
        if served.get("owned_by") == "llamacpp":
            props = await self.client.get("/props")
            props.raise_for_status()
            said = props.json()
            context = int(said["default_generation_settings"]["n_ctx"])
            slots = said.get("total_slots")
            slots = slots if isinstance(slots, int) and slots > 0 else None
            return Facts("llama.cpp", context, str(served["id"]), slots)
        return None

    async def count_tokens(self, facts: Facts, kind: str, body: Mapping[str, Any]) -> int | None:
        """The prompt's tokens as the serving runtime counts them; None if it cannot say."""
        try:
            if kind == CHAT:
                return await self._count_chat(facts, body)
            # Only the prompts that might not fit, and not too many of them (a batch of a
            # thousand long prompts is the runtime's to judge).
            texts = [p for p in text_prompts(body["prompt"]) if _may_overflow(p, facts)]
            if len(texts) > MAX_COUNTED_PROMPTS:
                return None
            return max([await self._count_text(facts, p) for p in texts], default=0)
        except Exception:  # the runtime cannot say: it judges the prompt itself
            return None

    async def _count_chat(self, facts: Facts, body: Mapping[str, Any]) -> int | None:
        if any(_media_in(m.get("content")) for m in body["messages"]):
            return None  # images and audio are the runtime's to count
        extra = {"tools": body["tools"]} if body.get("tools") else {}
        if facts.engine == "vLLM":
            request = {"model": facts.model, "messages": body["messages"], **extra}
            return count_field(await self._post("/tokenize", request))
        template = {"messages": body["messages"], **extra}
        prompt = json.loads(await self._post("/apply-template", template))["prompt"]
        return await self._count_text(facts, str(prompt))

    async def _count_text(self, facts: Facts, text: str) -> int:
        if facts.engine == "vLLM":
            request = {"model": facts.model, "prompt": text, "add_special_tokens": False}
            return count_field(await self._post("/tokenize", request))
        request = {"content": text, "add_special": False, "parse_special": True}
        return count_array(await self._post("/tokenize", request))

    async def _post(self, path: str, request: Mapping[str, Any]) -> bytes:
        response = await self.client.post(path, json=request)
        response.raise_for_status()
        return response.content


# A long prompt's answer lists every token id: they are counted in the raw answer, without
# making a Python int of each (a million of them, 30 MB, would stay in the proxy's RSS).


def count_field(answer: bytes) -> int:
    """vLLM's {"count": N, ..., "tokens": [...]}: N."""
    found = re.search(rb'"count"\s*:\s*(\d+)', answer)
    if found is None:
        raise ValueError("no count in the answer")
    return int(found[1])


def count_array(answer: bytes) -> int:
    """llama-server's {"tokens": [1, 2, ...]}: how many ids."""
    start, end = answer.index(b"["), answer.rindex(b"]")
    inside = answer[start + 1 : end]
    return inside.count(b",") + 1 if inside.strip() else 0


def _may_overflow(text: str, facts: Facts) -> bool:
    return utf8_bytes(text) + TEMPLATE_SLACK > facts.context


def text_prompts(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    return [p for p in prompt if isinstance(p, str)] if isinstance(prompt, list) else []


def utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _media_in(content: Any) -> bool:
    return isinstance(content, list) and any(
        not (isinstance(part, dict) and part.get("type") == "text") for part in content
    )
