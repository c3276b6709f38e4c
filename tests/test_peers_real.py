"""Two boxes, for real: two appliances, each under its own private user manager with its own
CPU llama-server. Box A lists box B in [peers]: A's :8000 is the front door for both, and
OpenAI-SDK clients on it are answered by both boxes. While B switches, or while B has no
runtime, A routes around it: no client sees an error."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.host import health
from b70tools import load_test
from b70tools.net import free_port
from tests.conftest import (
    B70CTL,
    Appliance,
    demo_config_text,
    llamacpp_counter,
    require_real_parts,
    running_manager,
    short_chats,
)


@dataclass
class Fleet:
    front: Appliance  # box A: its proxy is the front door
    peer: Appliance  # box B


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_real_parts()
    root = tmp_path_factory.mktemp("fleet")
    with ExitStack() as stack:
        boxes = []
        for name in ("b", "a"):  # B first: A's config names B's port
            manager = stack.enter_context(running_manager(root / name))
            proxy, backend = free_port(), free_port()
            extra = (
                ""
                if not boxes
                else f'\n[peers]\nurls = ["http://127.0.0.1:{boxes[0].proxy_port}"]\n'
            )
            config = root / name / "appliance.toml"
            # demo_config_text gives llama-server one thread: two servers of two spinning
            # threads on this 2-core machine slow each other to a fraction of a token per second.
            config.write_text(demo_config_text(proxy, backend, extra))
            if boxes:  # the fleet shares one key: A takes B's
                key_dir = Path(manager.env["XDG_CONFIG_HOME"]) / "b70"
                key_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy(
                    Path(boxes[0].manager.env["XDG_CONFIG_HOME"]) / "b70" / "proxy.env", key_dir
                )
                (key_dir / "proxy.env").chmod(0o600)
            box = Appliance(manager, config, proxy, backend)
            box.b70ctl("install", check=True)
            stack.callback(box.b70ctl, "uninstall", "--purge")
            boxes.append(box)
        yield Fleet(front=boxes[1], peer=boxes[0])
    shutil.rmtree(root, ignore_errors=True)


def predicted(port: int) -> float:
    return llamacpp_counter(port, "tokens_predicted_total")


def target(box: Appliance) -> load_test.Target:
    return load_test.Target(
        f"http://127.0.0.1:{box.proxy_port}", box.key, "smollm2",
        [B70CTL, "--user", "--config", str(box.config)],
    )  # fmt: skip


def test_the_front_door_is_answered_by_both_boxes(fleet: Fleet) -> None:
    assert fleet.front.key == fleet.peer.key
    ports = (fleet.front.backend_port, fleet.peer.backend_port)
    before = [predicted(p) for p in ports]
    short_chats(fleet.front, 16)
    after = [predicted(p) for p in ports]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def readiness(box: Appliance) -> int:
    return health.request("GET", f"http://127.0.0.1:{box.proxy_port}/health/readiness", 5).status


def test_a_peer_that_switches_or_is_down_is_routed_around(fleet: Fleet) -> None:
    """Eight clients on the front door while B restarts its runtime, then while B has none:
    every request is answered, and B's readiness said 503 meanwhile."""
    assert readiness(fleet.peer) == 200
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(readiness(fleet.peer))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()

    async def load() -> load_test.Report:
        report = load_test.Report(clients=8, steady_s=0)
        done = asyncio.Event()
        clients = [
            asyncio.create_task(load_test.client_loop(target(fleet.front), i, done, report, 16))
            for i in range(8)
        ]
        await asyncio.sleep(2)
        switch = await asyncio.to_thread(fleet.peer.b70ctl, "switch", "llamacpp", "--restart")
        assert switch.returncode == 0, switch.stderr
        stopped = await asyncio.to_thread(
            fleet.peer.manager.systemctl, "stop", "b70-llamacpp.service"
        )
        await asyncio.sleep(6)  # B has no runtime: every request must go to A
        done.set()
        await asyncio.gather(*clients)
        assert stopped is not None
        return report

    try:
        report = asyncio.run(load())
    finally:
        stop.set()
        watcher.join()
        fleet.peer.b70ctl("switch", "llamacpp")
    s = report.summary()
    print(load_test.render_summary(s))
    assert s["all"]["failed"] == 0 and s["all"]["truncated"] == 0, s["errors"]
    assert s["all"]["succeeded"] >= 24
    assert 503 in seen and seen[0] == 200, "B said it was not ready while it switched and was down"
    assert readiness(fleet.peer) == 200
