"""The status page's door and the monitor's ring of samples, without a manager: what is refused,
what the key lets in, and how the ring stays an hour long."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance import samples, statuspage
from appliance.config import parse
from appliance.layout import SAMPLES, Layout, Scope
from b70tools.net import free_port

KEY = "sk-b70-test-key"


def config_text(host: str, port: int) -> str:
    return f"""
default_runtime = "a"
[runtimes.a]
engine = "llamacpp"
model = "/m.gguf"
[monitor]
host = "{host}"
port = {port}
"""


@pytest.fixture(params=["127.0.0.1", "0.0.0.0"], ids=["loopback", "exposed"])
def page(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, bool]]:
    port = free_port()
    cfg = parse(config_text(request.param, port), tmp_path / "appliance.toml")
    lay = Layout(Scope.USER, tmp_path / "units", tmp_path / "etc", tmp_path / "state")
    lay.etc_dir.mkdir()
    lay.state_dir.mkdir()
    lay.key_file.write_text(f"LITELLM_MASTER_KEY={KEY}\n")
    from prometheus_client import CollectorRegistry

    server = statuspage.serve(statuspage.Page(cfg, lay, CollectorRegistry()), request.param, port)
    try:
        yield f"http://127.0.0.1:{port}", request.param != "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()


def test_the_page_is_shut_to_those_without_the_key_when_exposed(page: tuple[str, bool]) -> None:
    url, exposed = page
    first = httpx.get(url + "/")
    if not exposed:
        assert first.status_code == 200 and 'name="b70-token"' in first.text
        assert first.headers["X-Content-Type-Options"] == "nosniff"
        return
    assert first.status_code == 401 and KEY not in first.text
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    login = httpx.get(url + f"/?key={KEY}")
    assert login.status_code == 303 and login.headers["Location"] == "/"
    cookie = login.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    with httpx.Client(base_url=url, cookies=login.cookies) as client:
        assert client.get("/status.js").status_code == 200


def test_a_post_needs_the_pages_token_json_and_the_pages_origin(page: tuple[str, bool]) -> None:
    url, exposed = page
    auth = {"Authorization": f"Bearer {KEY}"} if exposed else {}
    http = httpx.Client()
    token = http.get(url + "/", headers=auth).text.split('content="', 2)[2].split('"', 1)[0]
    switch = url + "/api/switch"
    body = {"runtime": "a"}
    cases = [
        ({}, "token"),
        ({"X-B70-Token": token + "x"}, "token"),
        ({"X-B70-Token": token, "Origin": "http://evil.example"}, "evil.example"),
        ({"X-B70-Token": token, "Sec-Fetch-Site": "same-site"}, "another site"),
    ]
    for headers, why in cases:
        out = http.post(switch, json=body, headers={**auth, **headers})
        assert out.status_code == 403 and why in out.json()["error"]["message"], (headers, out.text)
    form = http.post(switch, data=body, headers={**auth, "X-B70-Token": token})
    assert form.status_code == 403 and "JSON" in form.json()["error"]["message"]
    unknown = http.post(switch, json={"runtime": "zz"}, headers={**auth, "X-B70-Token": token})
    assert unknown.status_code == 400 and "no runtime named 'zz'" in unknown.text
    bad = http.post(switch, content=b"[1", headers={**auth, "X-B70-Token": token,
                                                      "Content-Type": "application/json"})  # fmt: skip
    assert bad.status_code == 400
    assert http.get(url + "/nothing", headers=auth).status_code == 404
    http.close()


def test_the_ring_keeps_the_last_hour_and_drops_the_rest_in_one_rewrite(tmp_path: Path) -> None:
    t0 = 1_000_000.0
    for i in range(0, 4200, 10):  # 70 minutes, a sample every 10 s
        samples.append(tmp_path, {"t": t0 + i, "runtime": "a"}, now=t0 + i)
    kept = samples.read(tmp_path)
    now = t0 + 4190
    # Never more than an hour and the slack; the rewrite left the last hour.
    assert kept[0]["t"] >= now - samples.KEEP_S - samples.SLACK_S
    assert kept[-1]["t"] == now and len(kept) <= (samples.KEEP_S + samples.SLACK_S) / 10 + 1
    assert [s["t"] for s in samples.read(tmp_path, since=now - 25)] == [now - 20, now - 10, now]
    with (tmp_path / SAMPLES).open("a") as f:
        f.write('{"t": "broken"\n[]\n')
    samples.append(tmp_path, {"t": now + 10}, now=now + 10)
    assert samples.read(tmp_path)[-1]["t"] == now + 10
    assert all(isinstance(s["t"], float) for s in samples.read(tmp_path))
    assert json.loads((tmp_path / SAMPLES).read_text().splitlines()[-1])["t"] == now + 10


def test_a_sample_holds_each_runtime_side_by_side() -> None:
    from appliance.gpu import Snapshot
    from appliance.plans import Observation

    chat = Observation(5.0, "chat", "active", "running", 7, True, "", False, 2, 100.0)
    vision = Observation(5.0, "vision", "active", "running", 8, False, "", False, 1, 40.0)
    sample = samples.sample_of([chat, vision], 0, Snapshot([], 0, []))
    assert sample["runtime"] == "chat" and sample["in_flight"] == 3
    assert sample["healthy"] is False  # one runtime serving side by side does not answer
    assert sample["runtimes"] == {
        "chat": {"state": "active", "healthy": True, "in_flight": 2, "generated": 100.0},
        "vision": {"state": "active", "healthy": False, "in_flight": 1, "generated": 40.0},
    }
    nothing = Observation(5.0, None, None, None, None, False, "no runtime", False)
    empty = samples.sample_of([nothing], 0, Snapshot([], 0, []))
    assert empty["runtimes"] == {} and empty["in_flight"] is None and empty["healthy"] is False
