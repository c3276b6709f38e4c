"""Keys for people (appliance.people), their limits and usage (appliance.proxy.share,
appliance.usage), and the door taking them: in this process, in milliseconds."""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest

from appliance import people, usage
from appliance.proxy import door as proxy_door
from appliance.proxy.checks import Refusal
from appliance.proxy.share import limits as limits_mod
from appliance.proxy.share.meter import Meter, ask_usage
from tests import doorkit

# --- the keys file ------------------------------------------------------------------------------


def test_a_key_is_kept_as_its_hash_alone_and_read_back_as_written(tmp_path: Path) -> None:
    secret = people.new_secret()
    with people.editing(tmp_path) as everyone:
        people.added(everyone, "alice", secret, max_parallel=2, rpm=60, tpm=None, priority="batch")
    text = (tmp_path / people.KEYS_FILE).read_text()
    assert secret not in text and secret[len(people.SECRET_PREFIX) :] not in text
    assert (tmp_path / people.KEYS_FILE).stat().st_mode & 0o777 == 0o600
    alice = people.read_keys(tmp_path)["alice"]
    assert (alice.max_parallel, alice.rpm, alice.tpm, alice.priority) == (2, 60, None, "batch")
    assert people.identify(secret, "sk-master", {"alice": alice}) == alice


@pytest.mark.parametrize(
    "given",
    ["", "sk-wrong", "sk-master-but-longer", "ключ", "k" * 5_000_000, "sk-\udcff", "Bearer x"],
)
def test_a_key_of_no_one_is_no_ones(given: str) -> None:
    alice = people.Person("alice", people.digest_of("sk-alice"))
    assert people.identify(given, "sk-master", {"alice": alice}) is None


def test_a_megabyte_key_is_refused_without_hashing_it() -> None:
    """The same quick answer for a key of 5 MB as for a short wrong one: it is not hashed."""
    everyone = {f"p{i}": people.Person(f"p{i}", people.digest_of(f"s{i}")) for i in range(50)}
    huge = "k" * 5_000_000
    start = time.perf_counter()
    for _ in range(100):
        assert people.identify(huge, "sk-master", everyone) is None
    assert time.perf_counter() - start < 0.5  # hashing 5 MB 100 times takes seconds


def test_the_master_key_is_its_own(tmp_path: Path) -> None:
    assert people.identify("sk-master", "sk-master", {}) is people.MASTER_KEY
    assert people.identify("sk-master", "", {}) is None  # no master key set: none passes


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"version": 2, "keys": {}}',
        '{"version": 1, "keys": {"bad name": {"sha256": "00", "created": 1}}}',
        '{"version": 1, "keys": {"alice": {"sha256": "abcd", "created": 1}}}',
        '{"version": 1, "keys": {"alice": {"sha256": "' + "0" * 64 + '", "created": 1, "rpm": 0}}}',
        '{"version": 1, "keys": {"alice": {"sha256": "' + "0" * 64 + '", "created": 1, '
        '"priority": "vip"}}}',
    ],
)
def test_a_keys_file_that_makes_no_sense_is_said_so(text: str) -> None:
    with pytest.raises(ValueError):
        people.parse_keys(text)


def test_the_ring_sees_a_change_within_a_second_and_keeps_the_last_good_file(
    tmp_path: Path,
) -> None:
    now = [0.0]
    said: list[str] = []
    ring = people.KeyRing(
        tmp_path / people.KEYS_FILE, lambda: "sk-master", lambda: now[0], said.append
    )
    assert ring.who("sk-alice") is None
    with people.editing(tmp_path) as everyone:
        people.added(everyone, "alice", "sk-alice")
    assert ring.who("sk-alice") is None  # looked a moment ago
    now[0] += people.LOOK_EVERY_S
    assert ring.who("sk-alice").name == "alice"  # type: ignore[union-attr]
    (tmp_path / people.KEYS_FILE).write_text("{broken")
    for _ in range(3):
        now[0] += people.LOOK_EVERY_S
        assert ring.who("sk-alice").name == "alice"  # type: ignore[union-attr]
    assert len(said) == 1 and "last good one stands (1 keys)" in said[0], said
    (tmp_path / people.KEYS_FILE).unlink()
    now[0] += people.LOOK_EVERY_S
    assert ring.who("sk-alice") is None  # no file: no people's keys
    assert ring.who("sk-master") is people.MASTER_KEY


def test_a_broken_keys_file_is_not_written_over(tmp_path: Path) -> None:
    (tmp_path / people.KEYS_FILE).write_text("{broken")
    with pytest.raises(people.KeysUnreadable), people.editing(tmp_path) as everyone:
        people.added(everyone, "alice", "sk-alice")
    assert (tmp_path / people.KEYS_FILE).read_text() == "{broken"


def _add_one(state_dir: str, name: str) -> None:
    with people.editing(Path(state_dir)) as everyone:
        time.sleep(0.01)  # a window in which another command would lose its change
        people.added(everyone, name, f"sk-{name}")


def test_concurrent_keys_commands_never_lose_a_key(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_add_one, args=(str(tmp_path), f"p{i}")) for i in range(12)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(people.read_keys(tmp_path)) == sorted(f"p{i}" for i in range(12))


# --- limits ------------------------------------------------------------------------------------


def _limits(tmp_path: Path, now: list[float]) -> limits_mod.Limits:
    return limits_mod.Limits(tmp_path, clock=lambda: now[0])


def test_requests_at_once_over_the_limit_get_429_until_one_ends(tmp_path: Path) -> None:
    now = [1000.0]
    bob = people.Person("bob", b"x" * 32, max_parallel=2)
    shared = _limits(tmp_path, now)
    shared.admit(bob)
    shared.admit(bob)
    with pytest.raises(Refusal) as refused:
        _limits(tmp_path, now).admit(bob)  # another worker's view: the same file
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    assert "has 2 of its 2 requests at once open" in refused.value.message
    shared.done(bob, 10)
    shared.admit(bob)


def test_requests_a_minute_say_when_the_oldest_leaves(tmp_path: Path) -> None:
    now = [1000.0]
    bob = people.Person("bob", b"x" * 32, rpm=3)
    shared = _limits(tmp_path, now)
    for step in range(3):
        now[0] = 1000.0 + 10 * step
        shared.admit(bob)
        shared.done(bob, 0)
    now[0] = 1025.0
    with pytest.raises(Refusal) as refused:
        shared.admit(bob)
    assert refused.value.headers["Retry-After"] == "35"  # the first leaves the minute at 1060
    now[0] = 1060.5
    shared.admit(bob)


def test_tokens_a_minute_count_what_the_answers_used(tmp_path: Path) -> None:
    now = [1000.0]
    bob = people.Person("bob", b"x" * 32, tpm=100)
    shared = _limits(tmp_path, now)
    shared.admit(bob)
    shared.done(bob, 60)
    now[0] = 1030.0
    shared.admit(bob)
    shared.done(bob, 50)
    with pytest.raises(Refusal) as refused:
        shared.admit(bob)
    assert (
        refused.value.headers["Retry-After"] == "30" and "used 110 tokens" in refused.value.message
    )
    now[0] = 1060.5  # the first 60 left: 50 in the minute
    shared.admit(bob)


def test_limits_that_cannot_be_kept_let_the_request_go_on_and_say_so_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "held").write_text("a file where the folder would be")
    shared = _limits(tmp_path, [0.0])
    bob = people.Person("bob", b"x" * 32, max_parallel=1)
    for _ in range(3):
        shared.admit(bob)  # not refused: the counts cannot be kept
        shared.done(bob, 10)
    said = capsys.readouterr().err
    assert said.count("cannot keep the keys' limits") == 1, said


def test_a_key_without_limits_costs_no_file(tmp_path: Path) -> None:
    shared = _limits(tmp_path, [0.0])
    shared.admit(people.Person("free", b"x" * 32))
    assert not (tmp_path / "held").exists()


# --- the meter --------------------------------------------------------------------------------


def _metered(messages: list[dict[str, Any]], strip: bool = False) -> tuple[Meter, bytes]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    meter = Meter(send, strip)

    async def run() -> None:
        for m in messages:
            await meter(m)

    asyncio.run(run())
    return meter, b"".join(m.get("body", b"") for m in sent)


def _start(stream: bool) -> dict[str, Any]:
    kind = b"text/event-stream" if stream else b"application/json"
    return {"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]}


def _body(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_json_answer_gives_its_usage() -> None:
    answer = json.dumps({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 34}})
    meter, _ = _metered(
        [_start(False), _body(answer[:10].encode()), _body(answer[10:].encode(), False)]
    )
    assert (meter.tokens_in, meter.tokens_out) == (12, 34)


def test_the_door_takes_out_the_usage_chunk_it_asked_for_and_nothing_else() -> None:
    chunk = b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'
    usage_chunk = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n'
    stream = chunk + chunk + usage_chunk + b"data: [DONE]\n\n"
    pieces = [stream[i : i + 13] for i in range(0, len(stream), 13)]  # cut anywhere
    messages = [_start(True), *(_body(p) for p in pieces), _body(b"", False)]
    meter, sent = _metered(messages, strip=True)
    assert sent == chunk + chunk + b"data: [DONE]\n\n"
    assert (meter.tokens_in, meter.tokens_out) == (7, 2)
    meter, sent = _metered(messages, strip=False)  # the client asked for it: it stays
    assert sent == stream and (meter.tokens_in, meter.tokens_out) == (7, 2)


def test_responses_and_messages_streams_give_their_usage() -> None:
    responses = (
        b'event: response.created\ndata: {"type":"response.created","response":{"usage":null}}\n\n'
        b'event: response.completed\ndata: {"type":"response.completed","response":'
        b'{"usage":{"input_tokens":9,"output_tokens":4}}}\n\n'
    )
    meter, sent = _metered([_start(True), _body(responses[:50]), _body(responses[50:], False)])
    assert sent == responses and (meter.tokens_in, meter.tokens_out) == (9, 4)
    messages = (
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"input_tokens":11,"output_tokens":1}}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":5}}\n\n'
    )
    meter, _ = _metered([_start(True), _body(messages, False)])
    assert (meter.tokens_in, meter.tokens_out) == (11, 5)


def test_the_door_asks_a_stream_for_its_usage_only_when_the_client_did_not() -> None:
    data: dict[str, Any] = {"stream": True}
    assert ask_usage(data) and data["stream_options"] == {"include_usage": True}
    data = {"stream": True, "stream_options": {"include_usage": True}}
    assert not ask_usage(data)
    data = {"stream": False}
    assert not ask_usage(data) and "stream_options" not in data


# --- usage --------------------------------------------------------------------------------------


def test_usage_lines_add_up_since_any_moment(tmp_path: Path) -> None:
    now = [0.0]
    ledger = usage.Ledger(tmp_path, clock=lambda: now[0])
    ledger.add("alice", usage.Use(1, 10, 20, 0.5))
    ledger.add("bob", usage.Use(limited=1))  # within FLUSH_S: kept
    assert usage.read_usage(tmp_path)["alice"].tokens_out == 20
    assert "bob" not in usage.read_usage(tmp_path)
    now[0] += usage.FLUSH_S
    ledger.add("alice", usage.Use(1, 1, 2))
    totals = usage.Totals(tmp_path)
    assert totals()["alice"] == usage.Use(2, 11, 22, 0.5) and totals()["bob"].limited == 1
    assert usage.read_usage(tmp_path, since=time.time() + 10) == {}
    assert usage.usage_dir(tmp_path).stat().st_mode & 0o777 == 0o755  # anyone may read usage
    files = list(usage.usage_dir(tmp_path).glob("*.jsonl"))
    assert [f.name for f in files] == [f"{os.getpid()}.jsonl"]
    with files[0].open("a") as f:
        f.write('{"t": 1, "keys": {"alice": {"requests": -1}}}\n{"cut')  # not counted
    assert totals()["alice"].requests == 2


# --- the door -------------------------------------------------------------------------------------


class Answering(doorkit.Inner):
    """LiteLLM's place, answering with a usage object."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, lambda m: asyncio.sleep(0))
        body = json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 8}})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body.encode()})


def _door(tmp_path: Path) -> tuple[proxy_door.Door, Answering]:
    inner = Answering()
    ring = people.KeyRing(tmp_path / people.KEYS_FILE, lambda: doorkit.KEY)
    ticks = itertools.count(0, usage.FLUSH_S)
    ledger = usage.Ledger(tmp_path, clock=lambda: next(ticks))  # every line written at once
    app = proxy_door.Door(inner, None, lambda: doorkit.MODELS, keys=ring,
                          limits=limits_mod.Limits(tmp_path), ledger=ledger)  # fmt: skip
    return app, inner


def test_a_persons_key_passes_the_door_and_its_use_is_counted(tmp_path: Path) -> None:
    with people.editing(tmp_path) as everyone:
        people.added(everyone, "alice", "sk-alice", max_parallel=1)
    app, inner = _door(tmp_path)
    auth = {"authorization": "Bearer sk-alice"}
    answer = doorkit.call(app, "POST", "/v1/chat/completions", doorkit.chat(), auth)
    assert answer.status == 200, answer.body
    answer = doorkit.call(app, "POST", "/v1/chat/completions", doorkit.chat(stream=True), auth)
    assert json.loads(inner.calls[-1][1])["stream_options"] == {"include_usage": True}
    assert doorkit.call(app, "GET", "/v1/models", b"", {"x-api-key": "sk-alice"}).status == 200
    used = usage.read_usage(tmp_path)["alice"]
    assert (used.requests, used.tokens_in, used.tokens_out) == (2, 10, 16)
    doorkit.call(app, "POST", "/v1/chat/completions", doorkit.chat(), doorkit.AUTH)
    assert usage.read_usage(tmp_path)[people.MASTER].requests == 1


def test_a_revoked_or_unknown_key_is_401(
    tmp_path: Path,
) -> None:
    with people.editing(tmp_path) as everyone:
        people.added(everyone, "alice", "sk-alice")
    app, inner = _door(tmp_path)
    with people.editing(tmp_path) as everyone:
        del everyone["alice"]
    app.keys.looked = -1e9  # as if half a second had passed
    for key in ("sk-alice", "sk-bob", "ключ", "x" * 3_000_000):
        answer = doorkit.call(app, "POST", "/v1/chat/completions", doorkit.chat(),
                              {"authorization": f"Bearer {key}"})  # fmt: skip
        assert answer.status == 401 and "nor one that `b70ctl keys` made" in answer.error["message"]
    assert inner.calls == []


def test_only_the_master_key_passes_a_switchs_hold_with_its_token(tmp_path: Path) -> None:
    with people.editing(tmp_path) as everyone:
        people.added(everyone, "alice", "sk-alice")
    app, _ = _door(tmp_path)
    tokens: list[str | None] = []

    async def fast(request: Any, send: Any) -> None:
        tokens.append(request.token)

    app.fast = fast  # type: ignore[method-assign,assignment]
    hold_token = {"x-b70-hold-token": "t0k3n"}
    for auth in ({"authorization": "Bearer sk-alice"}, doorkit.AUTH):
        doorkit.call(app, "POST", "/v1/chat/completions", doorkit.chat(), {**auth, **hold_token})
    assert tokens == [None, "t0k3n"]


# --- the fleet's keys (front doors that share a Redis) --------------------------------------------


def test_the_fleets_usage_adds_every_hour_and_door_and_passes_over_what_is_not_a_count() -> None:
    hours = {
        3600: {"alice\trequests": "2", "alice\tin": "10", "alice\tqueued_s": "0.5"},
        7200: {"alice\trequests": "1", "bob\tlimited": "1", "bob\tout": "x", "odd": "1"},
    }
    found = usage.fleet_usage(hours)
    assert found["alice"] == usage.Use(3, 10, 0, 0.5, 0)
    assert found["bob"] == usage.Use(0, 0, 0, 0.0, 1)
