"""The request checks of the door (appliance.proxy.door), and what they ask the serving runtime.

Each check refuses a request with a Refusal in OpenAI's error shape, or lets it go on:

4. The JSON: valid JSON (400), an object (400), a known `model` (404, like OpenAI: the model
   and its aliases, as LiteLLM's router knows them from the rendered litellm.yaml), for chat a
   non-empty `messages` array of objects, for completions a `prompt` (400).
5. `max_tokens` and `max_completion_tokens`: integers, at least 1, at most the context (400).
6. The prompt against the context (400 `context_length_exceeded`), never refusing a prompt that
   fits. Most prompts cost nothing more: a tokenizer makes at most one token of each byte of
   text (byte-level BPE, and SentencePiece with byte fallback), and the JSON body has at least
   as many bytes as the text in it, so a body of at most `context - TEMPLATE_SLACK` bytes fits.
   A prompt far over is refused at once: no common vocabulary has a token longer than
   128 bytes (GPT-2's, cl100k, o200k; SmolLM2's longest is 81), so a text of N bytes has at
   least N / MAX_TOKEN_BYTES (256) tokens; for chat only the users' messages count, as every
   chat template renders them whole (some drop parts of earlier answers). Between the two, the
   serving runtime counts the prompt exactly with its own tokenizer (vLLM: POST /tokenize with
   the messages, which applies the chat template; llama-server: POST /apply-template, then
   /tokenize). Token-id prompts are counted as they are. The bound alone would be weak (an
   8 MiB body is only "at least 32768 tokens"), and counting alone slow on a large body (the
   runtime tokenizes all of it on its CPU). A prompt with images is not counted: the runtime
   judges it.

The context and the engine come from the serving runtime, asked once and kept (vLLM: GET
/v1/models, `max_model_len`; llama-server: GET /props, `default_generation_settings.n_ctx`, the
context of one slot). A kept answer older than FACTS_TTL_S is renewed in the background, and is
asked again before it would refuse a request, so a switch to a runtime with a longer context never
refuses a valid request; meanwhile a request checked against an older, longer context is checked
by the runtime itself. When the runtime cannot say (stopped, loading, during a switch), checks 5
and 6 pass and the request goes on to the request hold (appliance.proxy.hook).

What the runtime says is asked by appliance.proxy.backend.

Imported by the proxy: nothing from the rest of the controller but appliance.proxy.backend.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, Mapping
from contextvars import ContextVar
from typing import Any

from appliance.proxy import Send
from appliance.proxy.backend import (
    CHAT,
    COMPLETION,
    TEMPLATE_SLACK,
    Backend,
    Facts,
    text_prompts,
    utf8_bytes,
)

# No token is longer than this: the longest of GPT-2's, cl100k's and o200k's vocabularies is 128
# bytes, of SmolLM2's 81. A text of N bytes is at least N / MAX_TOKEN_BYTES tokens.
MAX_TOKEN_BYTES = 256


# The error shape of the request the door is answering: OpenAI's, or Anthropic's on the
# Messages routes (appliance.proxy.apis), set by the door for each request (each its own task).
SHAPE: ContextVar[str] = ContextVar("b70_error_shape", default="openai")
# Anthropic's error types by status (its API's errors page): the SDK raises by status, and
# shows the type and message.
ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


class Refusal(Exception):
    """A request the door answers itself, in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind = kind
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        if SHAPE.get() == "anthropic":
            kind = ANTHROPIC_TYPES.get(self.status)
            kind = kind or ("invalid_request_error" if self.status < 500 else "api_error")
            return json.dumps(
                {"type": "error", "error": {"type": kind, "message": self.message}}
            ).encode()
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()

    async def send(self, send: Send) -> None:
        body = self.body()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# --- the checks -----------------------------------------------------------------------------------


def parse_body(body: bytes) -> dict[str, Any] | Refusal:
    """The request's JSON object, or why not (400)."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        data = json.loads(body, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:
        return Refusal(400, f"the request body is not valid JSON: {e}", "invalid_json")
    if not isinstance(data, dict):
        given = "null" if data is None else json_type(data)
        return Refusal(400, f"the request body must be a JSON object, not {given}", "invalid_type")
    return data


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value == []:
        return "an empty array"
    names = {dict: "an object", list: "an array", str: "a string", int: "an integer"}
    return names.get(type(value), "a number")


def wrong(name: str, must: str, value: Any, given: str | None = None) -> Refusal:
    """`name` is missing or not what it must be."""
    if value is None:
        return Refusal(
            400, f"{name} is missing: it must be {must}", "missing_required_parameter", name
        )
    given = given or json_type(value)
    return Refusal(400, f"{name} must be {must}, not {given}", "invalid_type", name)


def check_shape(
    kind: str, data: Mapping[str, Any], models: Collection[str] | None
) -> Refusal | None:
    """Checks that need nothing but the request: model, messages or prompt, max_tokens."""
    refusal = check_model(data, models)
    if refusal is not None:
        return refusal
    if kind == CHAT:
        messages = data.get("messages")
        if not (isinstance(messages, list) and messages and _all(messages, dict)):
            some = isinstance(messages, list) and messages
            given = "an array with items that are not objects" if some else None
            return wrong("messages", "a non-empty array of message objects", messages, given)
    else:
        prompt = data.get("prompt")
        if not (isinstance(prompt, str) or _prompt_list(prompt)):
            return wrong("prompt", "a string, or an array of strings or of token ids", prompt)
    return check_count(data, "max_tokens") or check_count(data, "max_completion_tokens")


def check_count(data: Mapping[str, Any], name: str, required: bool = False) -> Refusal | None:
    """`name`, when given (or `required`): an integer of at least 1."""
    value = data.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        return wrong(name, "an integer", value)
    if value < 1:
        return Refusal(
            400, f"{name} must be at least 1, not {value}", "integer_below_min_value", name
        )
    return None


def check_model(data: Mapping[str, Any], models: Collection[str] | None) -> Refusal | None:
    """The request's `model`: a name this appliance serves (`models`; None: not known yet)."""
    model = data.get("model")
    if not isinstance(model, str):
        return wrong("model", "the name of a model this appliance serves", model)
    if models is not None and model not in models:
        served = ", ".join(sorted(models))
        return Refusal(
            404, f"The model `{model}` does not exist. This appliance serves: {served}.",
            "model_not_found", "model",
        )  # fmt: skip
    return None


def _all(items: list[Any], kind: type) -> bool:
    return all(isinstance(item, kind) for item in items)


def _prompt_list(prompt: Any) -> bool:
    if not (isinstance(prompt, list) and prompt):
        return False
    return _all(prompt, str) or _token_prompts(prompt) is not None


def _token_prompts(prompt: Any) -> list[list[int]] | None:
    """A prompt of token ids (one list, or a list of lists), or None."""
    if not isinstance(prompt, list):
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if all(isinstance(p, list) and p and _token_prompts(p) == [p] for p in prompt):
        return prompt
    return None


def max_tokens_refusal(
    data: Mapping[str, Any],
    facts: Facts,
    names: tuple[str, ...] = ("max_tokens", "max_completion_tokens"),
) -> Refusal | None:
    """An answer's most tokens (`names`) over the runtime's context."""
    for name in names:
        value = data.get(name)
        if isinstance(value, int) and value > facts.context:
            return Refusal(
                400, f"{name} is {value}, more than the context of the runtime that serves "
                f"({facts.engine}): {facts.context} tokens for the prompt and the answer together",
                "integer_above_max_value", name,
            )  # fmt: skip
    return None


def prompt_tokens_at_most(kind: str, data: Mapping[str, Any], body_bytes: int) -> int:
    """Tokens the prompt cannot exceed, whatever the tokenizer (see the module's docstring)."""
    tokens = _token_prompts(data["prompt"]) if kind == COMPLETION else None
    if tokens is not None:
        return max(len(t) for t in tokens)
    return body_bytes + TEMPLATE_SLACK


def prompt_tokens_at_least(kind: str, data: Mapping[str, Any]) -> tuple[int, bool]:
    """Tokens the prompt has at least, and whether that is its exact count: token ids exactly;
    text at least its UTF-8 bytes over MAX_TOKEN_BYTES (for chat, only the users' messages,
    which every chat template renders whole)."""
    if kind == COMPLETION:
        tokens = _token_prompts(data["prompt"])
        if tokens is not None:
            return max(len(t) for t in tokens), True
        return max(utf8_bytes(p) for p in text_prompts(data["prompt"])) // MAX_TOKEN_BYTES, False
    users = [m.get("content") for m in data["messages"] if m.get("role") == "user"]
    return sum(utf8_bytes(_text_of(c)) for c in users) // MAX_TOKEN_BYTES, False


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "".join(p for p in parts if isinstance(p, str))


def over_context(kind: str, tokens: int, exact: bool, facts: Facts) -> Refusal:
    size = f"{tokens} tokens" if exact else f"at least {tokens} tokens"
    return Refusal(
        400, f"this prompt is {size}, more than the context of the runtime that serves "
        f"({facts.engine}): {facts.context} tokens for the prompt and the answer together",
        "context_length_exceeded", "messages" if kind == CHAT else "prompt",
    )  # fmt: skip


async def check_request(
    kind: str,
    data: Mapping[str, Any],
    body_bytes: int,
    models: Collection[str] | None,
    backend: Backend | None,
) -> Refusal | None:
    """Checks 4 to 6 of a parsed request; `body_bytes`: the size of its body."""
    refusal = check_shape(kind, data, models)
    if refusal is not None or backend is None:
        return refusal

    async def judged(facts: Facts) -> Refusal | None:
        return await judge(kind, data, body_bytes, facts, backend)

    return await against_facts(backend, judged)


async def against_facts(
    backend: Backend, judged: Callable[[Facts], Awaitable[Refusal | None]]
) -> Refusal | None:
    """A request judged against what the serving runtime says, asked again before a refusal:
    never refused on an old answer. None when the runtime cannot say now (the hold and the
    runtime itself take over)."""
    facts = await backend.facts()
    if facts is None:
        return None
    refusal = await judged(facts)
    if refusal is not None:
        fresh = await backend.facts(fresh=True)
        if fresh != facts:
            refusal = await judged(fresh) if fresh else None
    return refusal


async def judge(
    kind: str, data: Mapping[str, Any], body_bytes: int, facts: Facts, backend: Backend
) -> Refusal | None:
    """Checks 5 and 6 against what the runtime said."""
    refusal = max_tokens_refusal(data, facts)
    if refusal is not None:
        return refusal
    if prompt_tokens_at_most(kind, data, body_bytes) <= facts.context:
        return None
    at_least, exact = prompt_tokens_at_least(kind, data)
    if at_least > facts.context or exact:
        return over_context(kind, at_least, exact, facts) if at_least > facts.context else None
    tokens = await backend.count_tokens(facts, kind, data)
    if tokens is not None and tokens > facts.context:
        return over_context(kind, tokens, True, facts)
    return None
