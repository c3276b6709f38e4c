"""Keys for people on the real appliance: `b70ctl keys` under a real user manager, the real
LiteLLM proxy's door taking them, the OpenAI and Anthropic SDKs as the clients, and `b70ctl usage`
and the monitor's metrics saying who used what."""

from __future__ import annotations

import concurrent.futures
import time
import tomllib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Appliance

pytestmark = pytest.mark.real


def _client(app: Appliance, key: str) -> Any:
    import openai

    url = f"http://127.0.0.1:{app.proxy_port}/v1"
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


def _chat(client: Any, stream: bool = False, max_tokens: int = 8) -> Any:
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=max_tokens, temperature=0, stream=stream,
    )  # fmt: skip


def _wait_for(check: Any, seconds: float = 15.0) -> Any:
    """`check()` once it passes: an AssertionError, or a 401 for a key the door has not seen yet
    (it looks at the keys file every half second), is tried again until `seconds` pass."""
    import openai

    deadline = time.monotonic() + seconds
    while True:
        try:
            result = check()
        except (AssertionError, openai.AuthenticationError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        return result


ONE_DOOR_S = 1.0  # `b70ctl keys` help, README, docs/security.md: a change counts within a second


def _within_a_second(check: Any) -> float:
    """Seconds from now (a `keys` command's return) to the send time of the first try of
    `check()` that passes (a 401 or an AssertionError until then); an AssertionError if none
    sent within ONE_DOOR_S passed, as the help promises. A try is sent every 0.05 s without
    waiting for the last to come back, so a busy machine's slow answer does not push the next
    try past the bound."""
    import concurrent.futures

    import openai

    start = time.monotonic()
    passed: list[float] = []

    def one(sent: float) -> None:
        try:
            check()
        except (AssertionError, openai.AuthenticationError):
            return
        passed.append(sent)

    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        tries = []
        while not passed and (sent := time.monotonic() - start) <= ONE_DOOR_S:
            tries.append(pool.submit(one, sent))
            time.sleep(0.05)
        concurrent.futures.wait(tries, timeout=120)
    for done in tries:
        done.result()  # an error of another kind is the test's
    if not passed:
        raise AssertionError(f"the door did not see the change within {ONE_DOOR_S} s")
    return min(passed)


@pytest.fixture
def keys(appliance: Appliance) -> Iterator[dict[str, str]]:
    """Keys made with `b70ctl keys add`, revoked after the test."""
    made: dict[str, str] = {}
    yield made
    for name in made:
        appliance.b70ctl("keys", "revoke", name)


def _add(app: Appliance, made: dict[str, str], name: str, *limits: str) -> str:
    doc = app.json("keys", "add", name, *limits)
    assert doc["ok"], doc
    made[name] = doc["result"]["key"]
    return made[name]


def _usage(app: Appliance, name: str) -> dict[str, Any]:
    rows = {r["key"]: r for r in app.json("usage", "--since", "1h")["result"]["keys"]}
    assert name in rows, rows
    return rows[name]


def test_a_persons_key_works_through_the_sdks_and_its_use_is_counted(
    appliance: Appliance, keys: dict[str, str]
) -> None:
    appliance.b70ctl("switch", "llamacpp", check=True)
    import openai

    secret = _add(appliance, keys, "alice")
    client = _client(appliance, secret)
    replies: list[Any] = []
    seen_s = _within_a_second(lambda: replies.append(_chat(client)))
    reply = replies[0]
    assert reply.usage.prompt_tokens > 0
    chunks = list(_chat(client, stream=True, max_tokens=16))
    # The door asked the stream for its usage; the client, who did not, gets no chunk for it
    assert chunks and all(c.choices for c in chunks), chunks[-1]
    import anthropic

    messages = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{appliance.proxy_port}", api_key=secret, max_retries=0
    ).messages.create(model="smollm2", max_tokens=8,
                      messages=[{"role": "user", "content": "Say hi."}])  # fmt: skip
    assert messages.usage.output_tokens > 0

    def counted() -> dict[str, Any]:
        row = _usage(appliance, "alice")
        assert row["requests"] >= 3 and row["out"] >= reply.usage.completion_tokens + 16, row
        assert row["in"] >= reply.usage.prompt_tokens * 2, row
        return row

    row = _wait_for(counted)
    monitor_port = tomllib.loads(appliance.config.read_text())["monitor"]["port"]

    def exported() -> None:
        text = httpx.get(f"http://127.0.0.1:{monitor_port}/metrics", timeout=10).text
        assert 'b70_key_requests_total{key="alice"}' in text, text[-2000:]
        assert 'b70_key_tokens_total{direction="out",key="alice"}' in text

    _wait_for(exported, 30)
    assert secret not in appliance.b70ctl("keys", "list").stdout

    def refused(old: Any) -> None:
        try:
            old.models.list()  # the door's key check, with no answer to wait for
        except openai.AuthenticationError as e:
            assert "nor one that `b70ctl keys` made" in str(e)
            return
        raise AssertionError("an old key still passes")

    rotated = appliance.json("keys", "rotate", "alice")["result"]["key"]
    new_client = _client(appliance, rotated)
    rotated_s = _within_a_second(lambda: refused(client))
    _within_a_second(lambda: new_client.models.list())
    appliance.b70ctl("keys", "revoke", "alice", check=True)
    del keys["alice"]
    revoked_s = _within_a_second(lambda: refused(new_client))
    print(
        f"\nfrom the command's return to the first request that showed it: new key "
        f"{seen_s:.2f} s, rotation {rotated_s:.2f} s, revocation {revoked_s:.2f} s; usage: {row}"
    )


def test_a_key_over_its_limit_gets_429_with_retry_after(
    appliance: Appliance, keys: dict[str, str]
) -> None:
    import openai

    appliance.b70ctl("switch", "llamacpp", check=True)
    secret = _add(appliance, keys, "bob", "--max-parallel", "1", "--rpm", "3")
    client = _client(appliance, secret)
    _wait_for(lambda: _chat(client))
    long = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=200, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = next(iter(long))  # bob's one request at once runs
    with pytest.raises(openai.RateLimitError) as refused:
        _chat(client)
    assert refused.value.response.headers["retry-after"] == "1"
    assert "has 1 of its 1 requests at once open" in str(refused.value)
    assert first is not None and sum(1 for _ in long) > 0

    early: list[str] = []  # 429s while the door had not yet counted the long one ended

    def third() -> None:  # the third in this minute, once the door counts the long one ended
        try:
            _chat(client)
        except openai.RateLimitError as e:
            if "requests at once" in str(e):
                early.append(str(e))
            assert "requests at once" not in str(e), "the door has not ended the long one yet"
            raise

    _wait_for(third, 10)
    with pytest.raises(openai.RateLimitError) as refused:
        _chat(client)
    wait = int(refused.value.response.headers["retry-after"])
    assert 1 <= wait <= 60 and "sent 3 requests in the last minute" in str(refused.value)

    def limited_twice() -> dict[str, Any]:  # each worker writes its counts within 2 s
        row = _usage(appliance, "bob")
        assert row["limited"] >= 2 + len(early) and row["requests"] >= 3, row
        return row

    row = _wait_for(limited_twice)
    # Each refusal counts: the one at once, any while the door had not yet seen the long one
    # end (the third's tries), and the one over the rate.
    assert row["limited"] == 2 + len(early) and row["requests"] == 3, (row, early)


def test_a_bad_key_of_any_shape_is_a_quick_401(appliance: Appliance) -> None:
    url = f"http://127.0.0.1:{appliance.proxy_port}/v1/chat/completions"
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    shapes = {
        "wrong": b"sk-b70-wrong",
        "not ascii": "sk-ключ".encode(),
        "12 KB long": b"k" * 12_000,
        "2 MB long": b"k" * 2_000_000,
    }

    def one(key: bytes) -> httpx.Response:
        headers = [(b"authorization", b"Bearer " + key), (b"content-type", b"application/json")]
        return httpx.post(url, json=body, headers=headers, timeout=30)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = dict(zip(shapes, pool.map(one, shapes.values()), strict=True))
    for shape, answer in answers.items():
        assert answer.status_code == 401, (shape, answer.text)
        assert answer.headers["www-authenticate"] == "Bearer", shape


def test_one_persons_request_goes_before_anothers_queue(
    appliance: Appliance, keys: dict[str, str]
) -> None:
    """llama.cpp runs two requests at once (the demo's --parallel 2): heavy sends eight long
    streams, so six wait at the door; light's one request, sent after them, starts before most of
    heavy's waiting ones (first come, first served would start it after all eight)."""
    import threading

    appliance.b70ctl("switch", "llamacpp", check=True)
    heavy = _client(appliance, _add(appliance, keys, "heavy"))
    light = _client(appliance, _add(appliance, keys, "light"))
    _wait_for(lambda: _chat(heavy))
    _wait_for(lambda: _chat(light))
    first: dict[str, float] = {}

    def stream(name: str, client: Any, tokens: int) -> None:
        chunks = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Tell a long story."}],
            max_tokens=tokens, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content and name not in first:
                first[name] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(f"heavy{i}", heavy, 120)) for i in range(8)]
    for t in threads:
        t.start()

    def two_running() -> None:
        assert len(first) >= 2, first

    _wait_for(two_running, 60)
    time.sleep(0.5)  # the other six are waiting at the door by now
    light_thread = threading.Thread(target=stream, args=("light", light, 4))
    light_thread.start()
    for t in [*threads, light_thread]:
        t.join(timeout=300)
    assert len(first) == 9, first
    after_light = [n for n, t in first.items() if n != "light" and t > first["light"]]
    assert len(after_light) >= 4, sorted(first.items(), key=lambda kv: kv[1])

    def queued() -> None:
        row = _usage(appliance, "heavy")
        assert row["requests"] >= 9 and row["queued_s"] > 0, row  # waited at the door

    _wait_for(queued)
