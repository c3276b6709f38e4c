"""The APIs a runtime speaks, by the one word each has everywhere (config, /v1/models, status):
which ones a runtime serves, read from its engine and flags, and what it would need to serve the
others.

Both engines serve the generative APIs of a generative model: llama-server (llama.cpp) and vLLM
each answer chat completions, completions, OpenAI Responses, Anthropic Messages and tokenize
themselves. Embeddings and rerank need a runtime started for them:

- llama-server serves embeddings only when started with `--embeddings` and a pooling that
  makes one vector of a text (`--pooling mean`, `cls` or `last`, or an embedding model's own;
  a generative model's default, `none`, is refused with 400 "Pooling type 'none' is not OAI
  compatible"), and rerank only with `--reranking` and a reranker model (its scores are what
  the model makes of them). Started so, it still serves generation (build 11434), though its
  `--help` says "restrict to embeddings"; with `--reranking` its embeddings are all zeros.
- vLLM serves embeddings or rerank when it runs its model as a pooling model: a model whose
  architecture is one (an embedding model or a cross-encoder), or `--runner pooling` with
  `--convert embed` (any model as an embedding model) or `--convert classify`. It then serves
  no generation. A model vLLM recognises as a pooling model by its architecture cannot be told
  from its flags: name its APIs with `runtimes.NAME.apis`.

Imported by the config (what a runtime serves) and by the proxy (the door opens a route for
each API): nothing else of the appliance.
"""

from __future__ import annotations

from collections.abc import Sequence

CHAT = "chat.completions"
COMPLETIONS = "completions"
RESPONSES = "responses"
MESSAGES = "messages"
EMBEDDINGS = "embeddings"
RERANK = "rerank"
TOKENIZE = "tokenize"

ALL = (CHAT, COMPLETIONS, RESPONSES, MESSAGES, EMBEDDINGS, RERANK, TOKENIZE)
GENERATIVE = (CHAT, COMPLETIONS, RESPONSES, MESSAGES, TOKENIZE)

LLAMACPP, VLLM = "llamacpp", "vllm"  # the engines, as the config names them
ENGINE_NAMES = {LLAMACPP: "llama.cpp", VLLM: "vLLM"}


def _flag_values(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """The values given to any of `flags` (`--flag VALUE` or `--flag=VALUE`), in order."""
    values = []
    for i, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in flags:
            if equals:
                values.append(value)
            elif i + 1 < len(args):
                values.append(args[i + 1])
    return values


def served(engine: str, args: Sequence[str]) -> tuple[str, ...]:
    """The APIs a runtime of `engine` started with `args` serves, in ALL's order."""
    if engine == LLAMACPP:
        if any(a in ("--reranking", "--rerank") for a in args) or "rank" in _flag_values(
            args, ("--pooling",)
        ):
            return (*GENERATIVE[:-1], RERANK, TOKENIZE)
        if any(a in ("--embeddings", "--embedding") for a in args):
            return (*GENERATIVE[:-1], EMBEDDINGS, TOKENIZE)
        return GENERATIVE
    if engine == VLLM:
        convert = _flag_values(args, ("--convert",))
        runner = _flag_values(args, ("--runner",))
        task = _flag_values(args, ("--task",))
        if "classify" in convert or any(t in ("score", "classify") for t in task):
            return (RERANK, TOKENIZE)
        embed = any(t in ("embed", "embedding") for t in task)
        if embed or "embed" in convert or "pooling" in runner:
            return (EMBEDDINGS, TOKENIZE)
        return GENERATIVE
    return GENERATIVE


def needs(engine: str, api: str) -> str:
    """What a runtime of `engine` would need to serve `api`: the end of a sentence that begins
    "... serves API only when"."""
    if engine == LLAMACPP:
        if api == EMBEDDINGS:
            return (
                "started with `--embeddings` and a pooling such as `--pooling mean` "
                "(runtimes.NAME.args), best with an embedding model"
            )
        if api == RERANK:
            return "started with `--reranking` and a reranker model (runtimes.NAME.args)"
        return "started without `--embeddings` or `--reranking`, with a generative model"
    if engine == VLLM:
        if api == EMBEDDINGS:
            return (
                "it runs an embedding model, or any model with `--runner pooling --convert "
                "embed` (runtimes.NAME.args)"
            )
        if api == RERANK:
            return (
                "it runs a reranker (cross-encoder) model, or one with `--runner pooling "
                "--convert classify` (runtimes.NAME.args)"
            )
        return "it runs a generative model, without `--runner pooling`"
    return "its runtime is started for it"
