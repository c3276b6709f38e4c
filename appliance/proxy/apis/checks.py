"""The door's checks of the APIs beside chat and completions (appliance.proxy.apis): what each
request must carry, refused with a 4xx before the runtime sees it (in the API's error shape,
which the door sets), and its token limits against the serving runtime's context.

- Every request: a `model` this appliance serves (404 otherwise, naming the served ones).
- Responses: `input`, a non-empty string or array of input items (objects);
  `max_output_tokens`, if given, an integer from 1 to the context.
- Messages: `messages`, a non-empty array of message objects; `max_tokens`, an integer from 1
  to the context, which Anthropic's API requires (its token count takes no `max_tokens`).
- Embeddings: `input`, a non-empty string, or a non-empty array of at most MAX_INPUTS strings
  (none empty) or of token ids, or of arrays of token ids (OpenAI's limit is 2048 inputs);
  `dimensions`, if given, at least 1; `encoding_format` "float" or "base64".
- Rerank: `query`, a non-empty string; `documents`, a non-empty array of at most MAX_DOCUMENTS
  strings (or objects with a `text`); `top_n`, if given, at least 1.
- Tokenize: the text as `content` (llama-server's word) or `prompt` (vLLM's); the door sends it
  under both, so either runtime reads it. Detokenize: `tokens`, an array of token ids.
- A prompt whose text alone is more tokens than the context (at least its UTF-8 bytes over
  MAX_TOKEN_BYTES, appliance.proxy.checks) is refused; one closer to the edge is the runtime's to
  judge, whose error is answered in the API's shape.

Imported by the proxy: nothing from the rest of the controller but appliance.proxy's own.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from appliance.proxy.apis import (
    COUNT_TOKENS,
    DETOKENIZE,
    EMBEDDINGS,
    MESSAGES,
    RERANK,
    RESPONSES,
    TOKENIZE,
)
from appliance.proxy.backend import Backend, Facts, utf8_bytes
from appliance.proxy.checks import (
    MAX_TOKEN_BYTES,
    Refusal,
    against_facts,
    check_count,
    check_model,
    json_type,
    max_tokens_refusal,
    wrong,
)

MAX_INPUTS = 2048  # embeddings' inputs in one request, OpenAI's limit
MAX_DOCUMENTS = 1000  # rerank's documents in one request, Cohere's limit


def check_api(kind: str, data: Mapping[str, Any], models: Collection[str] | None) -> Refusal | None:
    """What needs nothing but the request."""
    refusal = check_model(data, models)
    if refusal is not None:
        return refusal
    check = {
        RESPONSES: _responses,
        MESSAGES: _messages,
        COUNT_TOKENS: _count_tokens,
        EMBEDDINGS: _embeddings,
        RERANK: _rerank,
        TOKENIZE: _tokenize,
        DETOKENIZE: _detokenize,
    }[kind]
    return check(data)


def _stream(data: Mapping[str, Any]) -> Refusal | None:
    value = data.get("stream")
    if value is not None and not isinstance(value, bool):
        return wrong("stream", "true or false", value)
    return None


def _objects(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _responses(data: Mapping[str, Any]) -> Refusal | None:
    given = data.get("input")
    if not ((isinstance(given, str) and given) or _objects(given)):
        return wrong("input", "a non-empty string or array of input items", given, _given(given))
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        return wrong("instructions", "a string", instructions)
    return check_count(data, "max_output_tokens") or _stream(data)


def _messages(data: Mapping[str, Any]) -> Refusal | None:
    refusal = _count_tokens(data)
    if refusal is not None:
        return refusal
    return check_count(data, "max_tokens", required=True) or _stream(data)


def _count_tokens(data: Mapping[str, Any]) -> Refusal | None:
    messages = data.get("messages")
    if not _objects(messages):
        return wrong("messages", "a non-empty array of message objects", messages,
                      _given(messages))  # fmt: skip
    system = data.get("system")
    if system is not None and not isinstance(system, str | list):
        return wrong("system", "a string or an array of text blocks", system)
    return None


def _given(value: Any) -> str | None:
    if isinstance(value, list) and value:
        return "an array with items that are not objects"
    if value == "":
        return "an empty string"
    return None


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _embeddings(data: Mapping[str, Any]) -> Refusal | None:
    given = data.get("input")
    must = "a non-empty string, or a non-empty array of strings or of token ids"
    if isinstance(given, str):
        if not given:
            return wrong("input", must, given, "an empty string")
    elif not (isinstance(given, list) and given):
        return wrong("input", must, given)
    elif len(given) > MAX_INPUTS:
        return Refusal(
            400, f"input has {len(given)} items, more than the {MAX_INPUTS} one request takes: "
            "send them in several requests", "array_above_max_length", "input",
        )  # fmt: skip
    elif all(isinstance(s, str) for s in given):
        if not all(given):
            return wrong("input", must, given, "an array with an empty string")
    elif not (_token_ids(given) or all(_token_ids(t) and t for t in given)):
        return wrong("input", must, given, "an array of other things")
    refusal = check_count(data, "dimensions")
    if refusal is not None:
        return refusal
    encoding = data.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        return wrong("encoding_format", '"float" or "base64"', encoding, json.dumps(encoding))
    return None


def _rerank(data: Mapping[str, Any]) -> Refusal | None:
    query = data.get("query")
    if not (isinstance(query, str) and query):
        return wrong("query", "a non-empty string", query, _given(query))
    documents = data.get("documents")
    must = "a non-empty array of strings (or of objects with a text)"
    if not (isinstance(documents, list) and documents):
        return wrong("documents", must, documents)
    if len(documents) > MAX_DOCUMENTS:
        return Refusal(
            400, f"documents has {len(documents)} items, more than the {MAX_DOCUMENTS} one "
            "request takes: send them in several requests", "array_above_max_length",
            "documents",
        )  # fmt: skip
    if not all(isinstance(d, str) or (isinstance(d, dict) and isinstance(d.get("text"), str))
               for d in documents):  # fmt: skip
        return wrong("documents", must, documents, "an array of other things")
    return check_count(data, "top_n")


def _tokenize(data: Mapping[str, Any]) -> Refusal | None:
    text = data.get("content", data.get("prompt"))
    if not isinstance(text, str):
        return wrong("content", "the text to tokenize, a string (or give it as prompt)", text)
    return None


def _detokenize(data: Mapping[str, Any]) -> Refusal | None:
    tokens = data.get("tokens")
    if not _token_ids(tokens):
        return wrong("tokens", "an array of token ids", tokens, json_type(tokens))
    return None


def judge_api(kind: str, data: Mapping[str, Any], facts: Facts) -> Refusal | None:
    """The token limits against what the serving runtime said: the most tokens an answer may
    have, and the least the prompt's text has."""
    limit = {RESPONSES: "max_output_tokens", MESSAGES: "max_tokens"}.get(kind)
    refusal = max_tokens_refusal(data, facts, (limit,)) if limit else None
    if refusal is not None:
        return refusal
    at_least = _text_bytes(kind, data) // MAX_TOKEN_BYTES
    if at_least > facts.context:
        return Refusal(
            400, f"this prompt is at least {at_least} tokens, more than the context of the "
            f"runtime that serves ({facts.engine}): {facts.context} tokens",
            "context_length_exceeded", _PROMPT_FIELD.get(kind),
        )  # fmt: skip
    return None


_PROMPT_FIELD = {RESPONSES: "input", MESSAGES: "messages", COUNT_TOKENS: "messages",
                 TOKENIZE: "content"}  # fmt: skip


def _text_bytes(kind: str, data: Mapping[str, Any]) -> int:
    """The UTF-8 bytes of the longest one text the runtime takes whole as one prompt."""
    if kind == RESPONSES:
        given = data.get("input")
        return _bytes_in(given if isinstance(given, str) else _users(given))
    if kind in (MESSAGES, COUNT_TOKENS):
        return _bytes_in(_users(data.get("messages")))
    # Tokenize is how a client learns that a text is too long: it is always answered. Embeddings
    # and rerank take each input alone; the runtime judges each.
    return 0


def _users(items: Any) -> list[Any]:
    """The users' messages: every chat template renders them whole (some drop parts of earlier
    answers), so their text is a floor of the prompt."""
    if not isinstance(items, list):
        return []
    return [i for i in items if isinstance(i, dict) and i.get("role") == "user"]


def _bytes_in(value: Any) -> int:
    """The bytes of the text a request's content holds: strings, and the `text` and `content`
    of its objects, however deep."""
    if isinstance(value, str):
        return utf8_bytes(value)
    if isinstance(value, list):
        return sum(_bytes_in(v) for v in value)
    if isinstance(value, dict):
        return sum(_bytes_in(value.get(k)) for k in ("text", "content"))
    return 0


async def check_api_request(
    kind: str, data: Mapping[str, Any], models: Collection[str] | None, backend: Backend | None
) -> Refusal | None:
    """The checks of a parsed request of `kind`: its shape, then its tokens against what the
    serving runtime says (asked again before a refusal, as appliance.proxy.checks does)."""
    refusal = check_api(kind, data, models)
    if refusal is not None or backend is None:
        return refusal

    async def judged(facts: Facts) -> Refusal | None:
        return judge_api(kind, data, facts)

    return await against_facts(backend, judged)


def with_both_words(body: bytes, data: Mapping[str, Any]) -> bytes:
    """A tokenize body with its text under both engines' words: llama-server reads `content`,
    vLLM `prompt`, and each leaves the other alone."""
    if "content" in data and "prompt" in data:
        return body
    text = data.get("content", data.get("prompt"))
    return json.dumps({**data, "content": text, "prompt": text}, ensure_ascii=False).encode()
