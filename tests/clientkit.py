"""Clients that no one here wrote, each driving one API through the appliance's :8000 as its users
would: the OpenAI Python SDK (chat, completions, Responses streamed and not, embeddings), the
Anthropic Python SDK (Messages streamed and not, its token count), the `llm` command line, and
LangChain's OpenAI embeddings (a RAG library's embedding client). Each call checks what it got
and returns a line saying so."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anthropic
import openai

MODEL = "smollm2"
PROMPT = "Say hi in five words."
MAX_TOKENS = 16
EMBEDDING_DIMENSIONS = 576  # SmolLM2-135M's hidden size: llama-server's vectors with --pooling


class Door:
    """The appliance's :8000 and its key, as each client is pointed at it."""

    def __init__(self, port: int, key: str, scratch: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.key = key
        self.scratch = scratch  # the `llm` command line's own folder lives here

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.key, max_retries=0,
                             timeout=120)  # fmt: skip

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base, api_key=self.key, max_retries=0,
                                   timeout=120)  # fmt: skip


def openai_chat(door: Door) -> str:
    answer = door.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS
    )
    text = answer.choices[0].message.content
    assert text, answer
    return f"chat: {text!r}"


def openai_completion(door: Door) -> str:
    answer = door.openai().completions.create(model=MODEL, prompt="Once upon a time",
                                              max_tokens=MAX_TOKENS)  # fmt: skip
    assert answer.choices[0].text, answer
    return f"completion: {answer.choices[0].text!r}"


def openai_responses(door: Door) -> str:
    answer = door.openai().responses.create(model=MODEL, input=PROMPT,
                                            max_output_tokens=MAX_TOKENS)  # fmt: skip
    assert answer.output_text, answer
    return f"responses: {answer.output_text!r}"


def openai_responses_stream(door: Door) -> str:
    with door.openai().responses.stream(model=MODEL, input=PROMPT,
                                        max_output_tokens=MAX_TOKENS) as events:  # fmt: skip
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        final = events.get_final_response()
    assert deltas and "".join(deltas) == final.output_text, (deltas, final)
    return f"responses.stream: {len(deltas)} deltas, {final.output_text!r}"


def openai_embeddings(door: Door) -> str:
    answer = door.openai().embeddings.create(model=MODEL, input=["a cat", "a city by the sea"])
    vectors = [d.embedding for d in answer.data]
    assert [len(v) for v in vectors] == [EMBEDDING_DIMENSIONS] * 2, answer
    assert vectors[0] != vectors[1]
    return f"embeddings: 2 vectors of {len(vectors[0])}"


def anthropic_messages(door: Door) -> str:
    message = door.anthropic().messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}]
    )
    block = message.content[0]
    assert block.type == "text" and block.text, message
    return f"messages: {block.text!r}"


def anthropic_messages_stream(door: Door) -> str:
    with door.anthropic().messages.stream(
        model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    block = final.content[0]
    assert text and block.type == "text" and block.text == text, (text, final)
    assert final.stop_reason in ("end_turn", "max_tokens"), final
    return f"messages.stream: {text!r}"


def anthropic_count_tokens(door: Door) -> str:
    counted = door.anthropic().messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}]
    )
    assert counted.input_tokens > 0, counted
    return f"messages.count_tokens: {counted.input_tokens}"


def llm_cli(door: Door) -> str:
    """`llm -m b70 --key KEY PROMPT`, with the appliance as an OpenAI-compatible model in llm's
    own extra-openai-models.yaml (its documented way to add such a server). Without an
    api_key_name there, llm sends no key of the user's at all."""
    home = door.scratch / "llm"
    home.mkdir(parents=True, exist_ok=True)
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: b70\n  model_name: {MODEL}\n  api_base: {door.base}/v1\n  api_key_name: b70\n"
    )
    env = {**os.environ, "LLM_USER_PATH": str(home)}
    argv = [str(Path(sys.executable).parent / "llm"), "-m", "b70", "--key", door.key,
            "-o", "max_tokens", str(MAX_TOKENS), PROMPT]  # fmt: skip
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    return f"llm: {out.stdout.strip()!r}"


def langchain_embeddings(door: Door) -> str:
    """LangChain's OpenAIEmbeddings. check_embedding_ctx_length=False: else it first fetches
    tiktoken's cl100k_base from the internet to cut texts, which a box without it cannot."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=MODEL, base_url=door.base + "/v1", api_key=door.key,
                                  check_embedding_ctx_length=False, max_retries=0)  # fmt: skip
    vectors = embeddings.embed_documents(["a cat", "a city by the sea"])
    query = embeddings.embed_query("a cat")
    assert [len(v) for v in vectors] == [EMBEDDING_DIMENSIONS] * 2 and len(query) == len(vectors[0])
    return f"langchain embeddings: {len(vectors)} documents, a query"


GENERATING: list[Callable[[Door], str]] = [
    openai_chat, openai_completion, openai_responses, openai_responses_stream,
    anthropic_messages, anthropic_messages_stream, anthropic_count_tokens, llm_cli,
]  # fmt: skip
EMBEDDING: list[Callable[[Door], str]] = [openai_embeddings, langchain_embeddings]
