"""The status page in a real browser (Debian's headless Chromium): it reads the runtime, its
switch button switches with the phases appearing live, and its chart holds the monitor's samples.
A site whose name is rebound to this machine (DNS rebinding) gets neither the page nor a switch.

The appliance is the demo on a private user manager; its GPU is a fixture tree of one B70 whose
used VRAM the test sets per runtime (the xe memory-region reply on the render node), so the
chart has something to draw. Screenshots before, during and after the switch are saved under
$B70_ARTIFACTS (default: .artifacts/ in the checkout).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.layout import SAMPLES
from b70tools import gpu_trees as t
from b70tools.browser import Browser, chromium, wait
from b70tools.net import free_port
from tests.conftest import (
    B70CTL,
    REPO,
    Appliance,
    demo_config_text,
    require_real_parts,
    running_manager,
)

ARTIFACTS = Path(os.environ.get("B70_ARTIFACTS") or REPO / ".artifacts")
USED = {"llamacpp": 6 * t.GIB, "vllm": 21 * t.GIB}  # what the fixture card says each one holds


class Page:
    def __init__(self, app: Appliance, port: int, tree: Path, card: t.Card) -> None:
        self.app, self.url, self.tree, self.card = app, f"http://127.0.0.1:{port}/", tree, card
        self.port = port

    def hold(self, runtime: str) -> None:
        """The card's used VRAM, as the xe driver would report it with `runtime` loaded."""
        self.card.vram_used = USED[runtime]
        render = self.tree / "dev" / "dri" / (self.card.render or "")
        render.write_bytes(t.mem_regions_reply(self.card))

    def samples(self) -> list[dict[str, object]]:
        ring = Path(self.app.manager.env["XDG_STATE_HOME"]) / "b70" / SAMPLES
        return [json.loads(line) for line in ring.read_text().splitlines()]


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    require_real_parts()
    if chromium() is None:
        pytest.fail("chromium is not installed: scripts/bootstrap --test installs it (as root)")
    root = tmp_path_factory.mktemp("page")
    card = t.Card(t.B70, card="card1", render="renderD128")
    tree = t.build(root / "sysroot", [card], [])
    with running_manager(root / "manager") as manager:
        # Every unit of this manager reads the fixture card (scripts/user-manager has told them
        # where its journal is, as for the demo).
        manager.systemctl("set-environment", f"B70_SYSROOT={tree}")
        port = free_port()
        config = root / "appliance.toml"
        extra = f"\n[monitor]\nport = {port}\ninterval_s = 1\nprobe_completion = false\n"
        config.write_text(demo_config_text(free_port(), free_port(), extra))
        app = Appliance(manager, config, 0, 0)
        pg = Page(app, port, tree, card)
        pg.hold("llamacpp")
        app.b70ctl("install", check=True)
        try:
            app.b70ctl("switch", "llamacpp", check=True)
            yield pg
        finally:
            app.b70ctl("uninstall", "--purge")
    shutil.rmtree(root, ignore_errors=True)  # after the manager's stop, which reads its files


def serving_row(b: Browser) -> str:
    return str(
        b.evaluate(
            "(document.querySelector('tr.unit[data-active=active]')||{dataset:{}}).dataset.runtime || ''"
        )
    )


def test_the_page_reads_the_runtime_switches_live_and_charts_the_samples(page: Page) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with Browser() as b:
        b.goto(page.url)
        wait(lambda: serving_row(b) == "llamacpp", 30, "the page shows llamacpp serving")
        b.wait_for(
            "document.querySelectorAll('svg[data-card] polyline').length == 1", 30, "a chart"
        )
        b.screenshot(ARTIFACTS / "status-page-before.png")
        # Each runtime's row says the APIs it speaks through :8000.
        apis = b.evaluate("document.querySelector('[data-apis=llamacpp]').textContent")
        assert apis.split(" · ") == ["chat.completions", "completions", "responses", "messages",
                                     "embeddings", "tokenize"], apis  # fmt: skip
        assert "embeddings" not in b.evaluate(
            "document.querySelector('[data-apis=vllm]').textContent"
        )

        b.evaluate("document.querySelector('button[data-switch=vllm]').click()")
        phases = b.wait_for("document.querySelectorAll('#phases li').length >= 3 && "
                            "[...document.querySelectorAll('#phases li')].map(l => l.textContent)",
                            60, "the switch's phases on the page")  # fmt: skip
        assert any("holding: new requests wait" in p for p in phases), phases
        page.hold("vllm")  # the card fills as vLLM loads: the chart should see it rise
        b.screenshot(ARTIFACTS / "status-page-during.png")
        b.wait_for("document.querySelector('#job h2').textContent.startsWith('switched to vllm')",
                   300, "the switch's end on the page")  # fmt: skip
        final = b.evaluate("[...document.querySelectorAll('#phases li')].map(l => l.textContent)")
        assert any("verified: vllm answers" in p for p in final), final
        assert len(final) > len(phases), (phases, final)  # phases appeared while it ran
        wait(lambda: serving_row(b) == "vllm", 30, "the page shows vllm serving")
        assert page.app.json("status")["result"]["active_runtime"] == "vllm"
        b.wait_for("document.getElementById('journal').textContent.includes('b70-vllm')", 30,
                   "the serving runtime's journal on the page")  # fmt: skip

        # The chart holds the monitor's samples: as many points as the ring has for the card,
        # give or take the samples written since the page's last poll.
        def drawn() -> int:
            return int(b.evaluate(
                "+document.querySelector('svg[data-card] polyline').dataset.samples") or 0)  # fmt: skip

        wait(lambda: any(c["used"] == USED["vllm"] for s in page.samples()[-2:]
                         for c in s["cards"]), 30, "a sample of the full card")  # fmt: skip
        b.wait_for("document.querySelector('#switches tr.switch') !== null", 30, "the history")
        with_card = [s for s in page.samples() if s["cards"]]
        assert abs(drawn() - len(with_card)) <= 3, (drawn(), len(with_card))
        levels = {c["used"] for s in with_card for c in s["cards"]}  # type: ignore[attr-defined]
        assert {USED["llamacpp"], USED["vllm"]} <= levels
        b.screenshot(ARTIFACTS / "status-page-after.png")
        row = b.evaluate("document.querySelector('#switches tr.switch').textContent")
        assert "llamacpp → vllm" in row and "ok" in row
        why = "document.querySelector('#switches tr.switch [data-reason]').dataset.reason"
        assert b.evaluate(why) == "by hand"  # the page's button is a switch by hand
        # The switch verified vLLM through :8000 with the master key: the keys' table counts it
        b.wait_for("document.querySelector('#keys tr.key[data-key=master]') !== null", 30,
                   "the master key's use in the keys' table")  # fmt: skip
        used = b.evaluate("document.querySelector('#keys tr.key[data-key=master]').textContent")
        assert used.startswith("master") and not used.startswith("master0"), used


def test_a_switch_from_another_site_is_refused(page: Page) -> None:
    import httpx

    before = page.app.json("status")["result"]["active_runtime"]
    html = httpx.get(page.url).text
    token = html.split('name="b70-token" content="', 1)[1].split('"', 1)[0]
    post = {"json": {"runtime": "llamacpp"}}
    no_token = httpx.post(page.url + "api/switch", **post)  # type: ignore[arg-type]
    assert no_token.status_code == 403 and "token" in no_token.json()["error"]["message"]
    headers = {"X-B70-Token": token, "Origin": "http://evil.example"}
    other = httpx.post(page.url + "api/switch", headers=headers, **post)  # type: ignore[arg-type]
    assert other.status_code == 403 and "evil.example" in other.json()["error"]["message"]
    headers = {"X-B70-Token": token, "Sec-Fetch-Site": "cross-site"}
    other = httpx.post(page.url + "api/switch", headers=headers, **post)  # type: ignore[arg-type]
    assert other.status_code == 403
    form = httpx.post(page.url + "api/switch", headers={"X-B70-Token": token},
                      data={"runtime": "llamacpp"})  # fmt: skip
    assert form.status_code == 403 and "JSON" in form.json()["error"]["message"]
    assert page.app.json("status")["result"]["active_runtime"] == before  # nothing moved
    page_headers = httpx.get(page.url).headers
    assert "frame-ancestors 'none'" in page_headers["Content-Security-Policy"]


def test_a_site_rebound_to_this_machine_gets_neither_the_page_nor_a_switch(page: Page) -> None:
    """DNS rebinding: Chromium resolves attacker.example to 127.0.0.1, as a site's own DNS does
    after its first answer, so the site's page and scripts are of the origin
    http://attacker.example:PORT, same-origin with what that name now reaches. Even knowing the
    page's token, they get 421 for the page, /api/state and the switch; localhost is served."""
    import httpx

    before = page.app.json("status")["result"]["active_runtime"]
    other = "vllm" if before == "llamacpp" else "llamacpp"
    token = httpx.get(page.url).text.split('name="b70-token" content="', 1)[1].split('"', 1)[0]
    job = httpx.get(page.url + "api/state").json()["job"]
    rebound = f"http://attacker.example:{page.port}/"
    with Browser(flags=("--host-resolver-rules=MAP attacker.example 127.0.0.1",)) as b:
        b.goto(rebound)
        status = wait(lambda: b.status_of(rebound), 30, "the rebound name's answer")
        assert status == 421, status
        b.wait_for("document.readyState == 'complete'", 30, "the refusal, loaded")
        assert b.evaluate("document.querySelector('meta[name=\"b70-token\"]') === null")
        text = b.evaluate("document.documentElement.textContent")
        assert "Misdirected Request" in text and token not in text, text
        switch = json.dumps({"method": "POST", "body": json.dumps({"runtime": other}),
                             "headers": {"Content-Type": "application/json", "X-B70-Token": token}})  # fmt: skip
        answers = b.evaluate(
            "Promise.all([fetch('/api/state'), fetch('/metrics'), fetch('/status.js'), "
            f"fetch('/api/switch', {switch})].map(p => p.then(async r => [r.status, await r.text()])))",
            await_promise=True,
        )
        assert [status for status, _ in answers] == [421] * 4, answers
        assert all(token not in body for _, body in answers), answers
        # The page's own names are served in the same browser: localhost (kept on loopback by
        # Chromium itself) reads the runtime.
        b.goto(f"http://localhost:{page.port}/")
        wait(lambda: serving_row(b) == before, 30, f"the page at localhost shows {before}")
    assert httpx.get(page.url + "api/state").json()["job"] == job  # no switch was started
    assert page.app.json("status")["result"]["active_runtime"] == before


def test_a_switch_on_a_terminal_shows_the_phase_its_time_and_the_vram(page: Page) -> None:
    """b70ctl switch with its stderr on a pseudo-terminal draws one moving line."""
    import pty
    import subprocess
    import threading

    page.hold("llamacpp")
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    env = dict(page.app.manager.env, B70_SYSROOT=str(page.tree))
    argv = [B70CTL, "--user", "--config", str(page.app.config), "switch", "llamacpp"]
    try:
        out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=slave, timeout=300)
    finally:
        os.close(slave)
        reader.join(10)
        os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert out.returncode == 0, text
    assert "\r\x1b[K" in text  # redrawn in place
    loading = [f for f in text.split("\r\x1b[K") if "loading: b70-llamacpp.service" in f]
    assert loading and any("VRAM 0000:03:00.0 6.0/32.0 GiB" in f for f in loading), loading
    assert "  verified: llamacpp answers through port" in text  # each phase left with its time
    assert b"llamacpp is serving" in out.stdout
