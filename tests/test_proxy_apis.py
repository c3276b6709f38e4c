"""The APIs beside chat and completions at the door (appliance.proxy.apis): which ones a runtime
serves, each API's checks, its way straight to the runtime's own route against a real TCP
server (tests/directkit.py), errors in the API's own shape, the model list, and llama-server's
Responses stream mended for the OpenAI SDK (a stream it recorded, tests/fixtures)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance import apis
from appliance.config import load as load_config
from appliance.proxy import door as proxy_door
from appliance.proxy.apis import streams
from appliance.proxy.apis.checks import MAX_INPUTS, check_api
from appliance.proxy.apis.models import ModelsAnswer, describe
from appliance.proxy.backend import Backend, Facts
from appliance.proxy.waiting import HoldTimeout
from tests import directkit
from tests.directkit import KEY, Client, Runtime, Script, answer, stream
from tests.doorkit import AUTH, call, door

FIXTURES = Path(__file__).parent / "fixtures"
# llama-server started for embeddings or rerank still generates (build 11434)
EMBEDS = ("chat.completions", "completions", "responses", "messages", "embeddings", "tokenize")
RERANKS = ("chat.completions", "completions", "responses", "messages", "rerank", "tokenize")
MODELS = {"smollm2", "default"}

# --- which APIs a runtime serves ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "args", "served"),
    [
        ("llamacpp", [], apis.GENERATIVE),
        ("llamacpp", ["-c", "2048", "--embeddings", "--pooling", "mean"], EMBEDS),
        ("llamacpp", ["--embedding"], EMBEDS),
        ("llamacpp", ["--reranking"], RERANKS),
        ("llamacpp", ["--pooling=rank"], RERANKS),
        ("vllm", ["--max-model-len", "2048"], apis.GENERATIVE),
        ("vllm", ["--runner", "pooling"], ("embeddings", "tokenize")),
        ("vllm", ["--runner=pooling", "--convert=embed"], ("embeddings", "tokenize")),
        ("vllm", ["--convert", "classify"], ("rerank", "tokenize")),
        ("vllm", ["--task", "embed"], ("embeddings", "tokenize")),
    ],
)  # fmt: skip
def test_a_runtimes_apis_are_read_from_its_engine_and_flags(
    engine: str, args: list[str], served: tuple[str, ...]
) -> None:
    assert apis.served(engine, args) == served


def test_the_config_names_a_runtimes_apis_or_reads_them_from_its_flags(tmp_path: Path) -> None:
    path = tmp_path / "b70.toml"
    path.write_text("""
default_runtime = "chat"

[runtimes.chat]
engine = "llamacpp"
command = ["/usr/bin/true"]
model = "/m.gguf"

[runtimes.embed]
engine = "llamacpp"
command = ["/usr/bin/true"]
model = "/e.gguf"
args = ["--embeddings"]
port = 8002
served_model_name = "embed"

[runtimes.bge]
engine = "vllm"
model = "/bge"
apis = ["rerank", "tokenize"]
port = 8003
served_model_name = "bge"
""")
    config = load_config(path)
    assert config.runtimes["chat"].apis == apis.GENERATIVE
    assert config.runtimes["embed"].apis == EMBEDS
    assert config.runtimes["bge"].apis == ("rerank", "tokenize")


# --- each API's checks ----------------------------------------------------------------------------

OK: dict[str, dict[str, Any]] = {
    "responses": {"model": "smollm2", "input": "hi"},
    "messages": {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "count_tokens": {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]},
    "embeddings": {"model": "smollm2", "input": ["a", "b"]},
    "rerank": {"model": "smollm2", "query": "q", "documents": ["a", {"text": "b"}]},
    "tokenize": {"model": "smollm2", "content": "hi"},
    "detokenize": {"model": "smollm2", "tokens": [1, 2]},
}  # fmt: skip

BAD = [
    ("responses", {"model": "gpt-4"}, 404, "model", "does not exist"),
    ("responses", {"input": None}, 400, "input", "input is missing"),
    ("responses", {"input": ""}, 400, "input", "not an empty string"),
    ("responses", {"input": [1, 2]}, 400, "input", "items that are not objects"),
    ("responses", {"max_output_tokens": 0}, 400, "max_output_tokens", "at least 1, not 0"),
    ("responses", {"max_output_tokens": "8"}, 400, "max_output_tokens", "an integer, not a string"),
    ("responses", {"stream": "yes"}, 400, "stream", "true or false"),
    ("messages", {"max_tokens": None}, 400, "max_tokens", "max_tokens is missing"),
    ("messages", {"messages": []}, 400, "messages", "not an empty array"),
    ("messages", {"messages": 5}, 400, "messages", "not an integer"),
    ("messages", {"system": 5}, 400, "system", "a string or an array"),
    ("count_tokens", {"messages": None}, 400, "messages", "messages is missing"),
    ("embeddings", {"input": None}, 400, "input", "input is missing"),
    ("embeddings", {"input": ""}, 400, "input", "an empty string"),
    ("embeddings", {"input": []}, 400, "input", "not an empty array"),
    ("embeddings", {"input": ["a", ""]}, 400, "input", "an array with an empty string"),
    ("embeddings", {"input": ["a"] * (MAX_INPUTS + 1)}, 400, "input", "more than the 2048"),
    ("embeddings", {"input": [{"text": "a"}]}, 400, "input", "an array of other things"),
    ("embeddings", {"encoding_format": "int8"}, 400, "encoding_format", 'not "int8"'),
    ("embeddings", {"dimensions": -1}, 400, "dimensions", "at least 1"),
    ("rerank", {"query": ""}, 400, "query", "not an empty string"),
    ("rerank", {"documents": []}, 400, "documents", "not an empty array"),
    ("rerank", {"documents": ["a"] * 1001}, 400, "documents", "more than the 1000"),
    ("rerank", {"documents": [5]}, 400, "documents", "an array of other things"),
    ("rerank", {"top_n": 0}, 400, "top_n", "at least 1"),
    ("tokenize", {"content": None}, 400, "content", "a string"),
    ("detokenize", {"tokens": "1 2"}, 400, "tokens", "an array of token ids"),
]


@pytest.mark.parametrize(("kind", "change", "status", "param", "words"), BAD)
def test_each_api_refuses_a_bad_request_by_name(
    kind: str, change: dict[str, Any], status: int, param: str, words: str
) -> None:
    assert check_api(kind, OK[kind], MODELS) is None
    data = {k: v for k, v in {**OK[kind], **change}.items() if v is not None}
    refusal = check_api(kind, data, MODELS)
    assert refusal is not None
    assert (refusal.status, refusal.param) == (status, param), refusal.message
    assert words in refusal.message


# --- the door: key, errors in the API's shape ------------------------------------------------------


def test_an_anthropic_client_gets_anthropic_errors_and_may_send_its_key_as_x_api_key() -> None:
    door_app, inner = door()
    body = json.dumps(OK["messages"]).encode()
    nokey = call(door_app, "POST", "/v1/messages", body)
    assert nokey.status == 401
    error = json.loads(nokey.body)
    assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
    assert "x-api-key" in error["error"]["message"]
    bad = json.dumps({**OK["messages"], "max_tokens": 0}).encode()
    refused = call(door_app, "POST", "/v1/messages", bad, {"x-api-key": KEY})
    assert refused.status == 400
    assert json.loads(refused.body) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "max_tokens must be at least 1, not 0",
        },
    }
    # An OpenAI client on the next request gets OpenAI's shape again (the shape is per request).
    other = call(door_app, "POST", "/v1/responses", b"{}", AUTH)
    assert other.status == 400 and other.error["param"] == "model"
    assert inner.calls == []


def test_a_form_or_a_wrong_api_s_body_is_a_quick_4xx_in_that_apis_shape() -> None:
    door_app, _ = door()
    form = call(door_app, "POST", "/v1/messages", b"a=b",
                {**AUTH, "content-type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert form.status == 415 and json.loads(form.body)["error"]["type"] == "invalid_request_error"
    chat_body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
    for path, param in (("/v1/responses", "input"), ("/v1/embeddings", "input"),
                        ("/v1/rerank", "query"), ("/v1/messages", "max_tokens")):  # fmt: skip
        answer_ = call(door_app, "POST", path, chat_body.encode(), AUTH)
        assert answer_.status == 400, path
        error = json.loads(answer_.body)["error"]
        assert error.get("param", param) == param and param in error["message"], path


# --- the door: straight to the runtime's own route ------------------------------------------------


def through(path: str, body: dict[str, Any], script: Script | None, engine: str = "llama.cpp",
            ready: int = 0) -> tuple[Client, Runtime]:  # fmt: skip
    """One request to `path` through a door whose model is served by a scripted runtime (None:
    nothing listens, and the runtime serves again after `ready` waits)."""
    client, holder = Client(), dict[str, Runtime]()
    waits: list[float] = []

    async def wait_ready(limit_s: float, token: str | None) -> float:
        waits.append(limit_s)
        if len(waits) > ready:
            raise HoldTimeout("the runtime is down", limit_s, 5)
        return 0.0

    async def hold(token: str | None) -> float:
        return 0.0

    async def scenario() -> None:
        async with Runtime(script or answer(200, b"")) as runtime:
            holder["runtime"] = runtime
            target = runtime.target()
            if script is None:
                runtime.server.close()  # type: ignore[union-attr]
                await runtime.server.wait_closed()  # type: ignore[union-attr]
            backend = Backend("http://runtime")
            backend.known = Facts(engine, 2048, "smollm2")
            backend.known_at = 1e18  # never asked
            door_app = proxy_door.Door(
                inner_app, backend, lambda: MODELS, lambda: KEY, wait_ready=wait_ready,
                hold_s=60, hold=hold, direct_to=lambda name: target,
            )  # fmt: skip
            await directkit.through(door_app, client, path, json.dumps(body).encode())

    async def inner_app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("these routes never go LiteLLM's way")

    asyncio.run(scenario())
    return client, holder["runtime"]


def _target_of(head: bytes) -> bytes:
    return head.split(b" ")[1]


@pytest.mark.parametrize(
    ("path", "kind", "runtime_path"),
    [
        ("/v1/responses", "responses", b"/v1/responses"),
        ("/responses", "responses", b"/v1/responses"),
        ("/v1/messages", "messages", b"/v1/messages"),
        ("/v1/messages/count_tokens", "count_tokens", b"/v1/messages/count_tokens"),
        ("/v1/embeddings", "embeddings", b"/v1/embeddings"),
        ("/embeddings", "embeddings", b"/v1/embeddings"),
        ("/v1/rerank", "rerank", b"/v1/rerank"),
        ("/rerank", "rerank", b"/v1/rerank"),
        ("/tokenize", "tokenize", b"/tokenize"),
        ("/detokenize", "detokenize", b"/detokenize"),
    ],
)
def test_each_api_goes_to_the_runtimes_own_route(path: str, kind: str, runtime_path: bytes) -> None:
    body = {**OK[kind], "model": "default"}  # an alias: the runtime gets the served name
    client, runtime = through(path, body, answer(200, b'{"ok": 1}'))
    assert (client.status, client.body) == (200, b'{"ok": 1}')
    head, sent = runtime.requests[0]
    assert _target_of(head) == runtime_path
    assert json.loads(sent)["model"] == "smollm2"
    assert b"authorization" not in head.lower(), "no header of the client's reaches the runtime"


def test_tokenize_gives_the_text_under_both_engines_words() -> None:
    for word in ("content", "prompt"):
        _, runtime = through("/tokenize", {"model": "smollm2", word: "héllo"}, answer(200, b"{}"))
        sent = json.loads(runtime.requests[0][1])
        assert sent["content"] == sent["prompt"] == "héllo"


def test_an_api_the_runtime_does_not_serve_is_a_501_naming_what_it_needs() -> None:
    said = (
        b'{"error":{"code":501,"message":"This server does not support embeddings. Start it '
        b'with `--embeddings`","type":"not_supported_error"}}'
    )  # llama-server's own words
    client, _ = through("/v1/embeddings", OK["embeddings"], answer(501, said))
    assert client.status == 501
    error = json.loads(client.body)["error"]
    assert error["code"] == "b70_api_not_served" and error["type"] == "not_implemented"
    assert "(llama.cpp) does not serve embeddings" in error["message"]
    assert "llama.cpp serves embeddings only when started with `--embeddings`" in error["message"]
    # vLLM running a generative model has no such route at all: 404, the same answer
    client, _ = through("/v1/rerank", OK["rerank"], answer(404, b'{"detail":"Not Found"}'), "vLLM")
    error = json.loads(client.body)["error"]
    assert (
        client.status == 501
        and "vLLM serves rerank only when it runs a reranker" in (error["message"])
    )
    # ... and in Anthropic's shape on its route
    client, _ = through("/v1/messages", OK["messages"], answer(404, b"no"), "vLLM")
    assert client.status == 501
    assert json.loads(client.body)["error"]["type"] == "api_error"


def test_a_runtime_that_does_not_know_the_model_answers_404_and_it_stays_one() -> None:
    said = (
        b'{"error":{"message":"The model `other` does not exist.","type":"NotFoundError",'
        b'"param":"model","code":404}}'
    )  # vLLM's own words for a model it does not serve
    client, _ = through("/v1/embeddings", OK["embeddings"], answer(404, said), "vLLM")
    assert client.status == 404
    error = json.loads(client.body)["error"]
    assert (
        error["message"]
        == "the runtime (vLLM) refused the request: The model `other` does not exist."
    )
    assert error["type"] == "NotFoundError" and error["code"] == "model_not_found"


def test_a_runtime_error_is_answered_in_the_apis_shape_and_names_the_runtime() -> None:
    said = (
        b'{"error":{"code":400,"message":"Field \'temperature\': type must be number",'
        b'"type":"invalid_request_error"}}'
    )
    client, _ = through("/v1/messages", OK["messages"], answer(400, said))
    assert client.status == 400
    assert json.loads(client.body) == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "the runtime (llama.cpp) refused the request: Field 'temperature': type "
        "must be number",
    }}  # fmt: skip
    client, _ = through("/v1/responses", OK["responses"], answer(500, b"it broke"))
    assert client.status == 500
    assert json.loads(client.body)["error"]["message"] == (
        "the runtime (llama.cpp) refused the request: it broke"
    )


def test_a_runtime_that_is_down_holds_the_request_then_it_is_sent_again() -> None:
    client, runtime = through("/v1/embeddings", OK["embeddings"], None, ready=5)
    assert client.status == 503  # down all along: 3 tries, then the hold's answer
    error = json.loads(client.body)["error"]
    assert error["code"] == "b70_hold_timeout" and runtime.requests == []


def test_a_stream_passes_through_whole() -> None:
    events = [b'event: message_start\ndata: {"type":"message_start"}\n\n',
              b'event: message_stop\ndata: {"type":"message_stop"}\n\n']  # fmt: skip
    client, _ = through("/v1/messages", {**OK["messages"], "stream": True}, stream(events))
    assert client.status == 200 and client.body == b"".join(events) and client.finished


# --- llama-server's Responses stream, mended --------------------------------------------------------


def sdk_stream(body: bytes) -> tuple[list[str], Any]:
    """The OpenAI SDK's responses.stream() reading `body` as the server's answer."""
    from openai import OpenAI  # here: importing it takes most of a second, in every worker

    headers = {"content-type": "text/event-stream"}
    transport = httpx.MockTransport(lambda _: httpx.Response(200, headers=headers, content=body))
    client = OpenAI(
        base_url="http://x/v1", api_key="x", http_client=httpx.Client(transport=transport)
    )
    with client.responses.stream(model="smollm2", input="hi") as events:
        kinds: list[str] = [e.type for e in events]
        return kinds, events.get_final_response()


def test_llama_servers_responses_stream_is_mended_for_the_openai_sdk() -> None:
    raw = (FIXTURES / "llama-server-responses.sse").read_bytes()  # build 11434, as it sent it
    with pytest.raises((TypeError, AttributeError)):
        sdk_stream(raw)
    text = "Zembra, your AI-powered chat assistant! I'm a creative AI"
    for size in (3, 97, len(raw)):  # however the runtime's writes cut it
        mend = streams.mend_for("responses", True)
        assert mend is not None
        out = b"".join(mend.feed(raw[i : i + size]) for i in range(0, len(raw), size)) + mend.end()
        kinds, final = sdk_stream(out)
        assert final.output_text == text and final.status == "completed"
        assert kinds.count("response.output_text.delta") == 16
        numbers = [json.loads(line[5:])["sequence_number"]
                   for line in out.splitlines() if line.startswith(b"data:")]  # fmt: skip
        assert numbers == list(range(len(numbers)))


def test_the_mend_changes_no_field_the_runtime_gave() -> None:
    event = {"type": "response.output_text.delta", "item_id": "m", "output_index": 3,
             "content_index": 2, "sequence_number": 40, "delta": "x", "logprobs": []}  # fmt: skip
    mend = streams.ResponsesMend()
    out = mend.feed(b"event: response.output_text.delta\ndata: " + json.dumps(event).encode()
                    + b"\n\ndata: [DONE]\n\n")  # fmt: skip
    first, done = out.split(b"\n\n")[:2]
    assert json.loads(first.split(b"data: ")[1]) == event and done == b"data: [DONE]"
    assert mend.faithful, "a stream whose first event is OpenAI's whole passes on unparsed"
    assert mend.feed(b"data: {not json\n\n") == b"data: {not json\n\n"
    assert streams.mend_for("responses", False) is None
    assert streams.mend_for("messages", False) is None


def anthropic_stream(body: bytes) -> Any:
    """The Anthropic SDK's messages.stream() reading `body` as the server's answer."""
    import anthropic  # here: importing it takes most of a second, in every worker
    import httpx2  # the Anthropic SDK's own HTTP client (a fork of httpx)

    headers = {"content-type": "text/event-stream"}
    answer = lambda _: httpx2.Response(200, headers=headers, content=body)  # noqa: E731
    client = anthropic.Anthropic(
        base_url="http://x",
        api_key="x",
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )
    with client.messages.stream(
        model="smollm2", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def test_a_messages_stream_without_its_message_start_gets_one_for_the_anthropic_sdk() -> None:
    raw = (FIXTURES / "llama-server-messages-no-start.sse").read_bytes()  # build 11434
    assert not raw.startswith(b"event: message_start")
    with pytest.raises(AssertionError):
        anthropic_stream(raw)
    for size in (3, 97, len(raw)):  # however the runtime's writes cut it
        mend = streams.mend_for("messages", True, "smollm2")
        assert mend is not None
        out = b"".join(mend.feed(raw[i : i + size]) for i in range(0, len(raw), size)) + mend.end()
        assert out.startswith(b"event: message_start") and out.endswith(raw)
        text, final = anthropic_stream(out)
        assert text and final.content[0].text == text and final.model == "smollm2"
        assert final.stop_reason in ("end_turn", "max_tokens")


def test_a_whole_messages_stream_passes_as_it_comes() -> None:
    raw = (FIXTURES / "llama-server-messages.sse").read_bytes()
    assert raw.startswith(b"event: message_start")
    mend = streams.mend_for("messages", True, "smollm2")
    assert mend is not None
    assert b"".join(mend.feed(raw[i : i + 50]) for i in range(0, len(raw), 50)) + mend.end() == raw
    error = b'event: error\ndata: {"type": "error", "error": {"type": "x", "message": "y"}}\n\n'
    mend = streams.MessagesMend("smollm2")
    assert mend.feed(error) == error


# --- the model list --------------------------------------------------------------------------------

RUNTIMES = {
    "llamacpp": {"engine": "llamacpp", "apis": list(apis.GENERATIVE)},
    "embed": {"engine": "llamacpp", "apis": ["embeddings", "tokenize"]},
    "vllm": {"engine": "vllm", "apis": list(apis.GENERATIVE)},
}


def test_the_model_list_says_which_apis_each_name_speaks() -> None:
    two = {k: RUNTIMES[k] for k in ("llamacpp", "vllm")}
    now = describe(two, "vLLM")
    assert now["apis"] == list(apis.GENERATIVE) and now["serving_runtime"] == "vllm"
    assert set(now["apis_by_runtime"]) == {"llamacpp", "vllm"}
    unknown = describe(RUNTIMES, None)  # not known which serves: any of them may
    assert unknown["apis"] == [a for a in apis.ALL if a != "rerank"]
    assert "serving_runtime" not in unknown
    ambiguous = describe(RUNTIMES, "llama.cpp")  # two llama.cpp runtimes take turns there
    assert "serving_runtime" not in ambiguous


def test_litellms_model_list_gets_the_apis_on_its_way_out() -> None:
    listing = {"object": "list", "data": [
        {"id": "smollm2", "object": "model", "owned_by": "openai"},
        {"id": "peer-only", "object": "model", "owned_by": "openai"},
    ]}  # fmt: skip
    body = json.dumps(listing).encode()
    client = Client()
    runtimes_of = {"smollm2": {"llamacpp": RUNTIMES["llamacpp"]}}.get

    async def scenario() -> None:
        async def engine_of(name: str) -> str | None:
            return "llama.cpp"

        send = ModelsAnswer(client.send, runtimes_of, engine_of)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body[:10], "more_body": True})
        await send({"type": "http.response.body", "body": body[10:]})

    asyncio.run(scenario())
    got = json.loads(client.body)
    assert got["data"][0]["apis"] == list(apis.GENERATIVE)
    assert got["data"][0]["serving_runtime"] == "llamacpp"
    assert "apis" not in got["data"][1]
    assert client.headers[b"content-length"] == b"%d" % len(client.body)
