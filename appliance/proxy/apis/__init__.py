"""The APIs the door opens beside chat completions and completions: OpenAI Responses, Anthropic
Messages (and its token count), embeddings, rerank, tokenize and detokenize. Each goes straight
to the runtime that serves its model, to the runtime's own route for it (both engines serve
each one themselves: appliance.apis), with the door's key check, body limit, hold and resend,
and checks of its own (`checks`); a refusal and a runtime's error are answered in the API's own
error shape (`answers`), and a stream the official SDKs could not read is mended (`streams`).

May import: the core modules and appliance.proxy's own (checks, backend, direct, asgi).
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance import apis

OPENAI, ANTHROPIC = "openai", "anthropic"  # the error shapes (appliance.proxy.checks.Refusal)

# The door's words for these routes (its kinds), beside appliance.proxy.backend's CHAT and
# COMPLETION.
RESPONSES = "responses"
MESSAGES = "messages"
COUNT_TOKENS = "count_tokens"
EMBEDDINGS = "embeddings"
RERANK = "rerank"
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"


@dataclass(frozen=True)
class Route:
    kind: str
    api: str  # the API it belongs to (appliance.apis): count_tokens is Messages', and so on
    paths: tuple[str, ...]  # where clients ask for it on :8000
    endpoint: str  # where the runtime serves it: under its api_base (/v1), or from its root
    at_root: bool = False
    shape: str = OPENAI
    streams: bool = False  # the API streams when the body asks for it


ROUTES = (
    Route(RESPONSES, apis.RESPONSES, ("/v1/responses", "/responses"), "/responses",
          streams=True),
    Route(MESSAGES, apis.MESSAGES, ("/v1/messages",), "/messages", shape=ANTHROPIC,
          streams=True),
    Route(COUNT_TOKENS, apis.MESSAGES, ("/v1/messages/count_tokens",),
          "/messages/count_tokens", shape=ANTHROPIC),
    Route(EMBEDDINGS, apis.EMBEDDINGS, ("/v1/embeddings", "/embeddings"), "/embeddings"),
    Route(RERANK, apis.RERANK, ("/v1/rerank", "/rerank"), "/rerank"),
    Route(TOKENIZE, apis.TOKENIZE, ("/tokenize",), "/tokenize", at_root=True),
    Route(DETOKENIZE, apis.TOKENIZE, ("/detokenize",), "/detokenize", at_root=True),
)  # fmt: skip
BY_KIND = {route.kind: route for route in ROUTES}
BY_PATH = {path: route for route in ROUTES for path in route.paths}


def shape_of(path: str) -> str:
    """The error shape of a path on :8000: Anthropic's under /v1/messages, else OpenAI's."""
    route = BY_PATH.get(path)
    return route.shape if route is not None else OPENAI


def endpoint_of(kind: str, base_path: str) -> str:
    """The runtime's path for a route, its api_base's path being `base_path` (/v1)."""
    route = BY_KIND[kind]
    return route.endpoint if route.at_root else base_path + route.endpoint
