"""How often one request reaches a runtime that dies on it, through the real proxy: the door's
fast way once, then the full way at most twice more (relay.REPLAYS), and LiteLLM itself sends
nothing again. A runtime that crashes on a request must not be crashed again and again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from appliance.layout import MONITOR_UNIT
from appliance.proxy import relay
from b70tools.net import free_port
from tests.conftest import (
    Appliance,
    demo_config_text,
    installed,
    require_real_parts,
    running_manager,
)


@pytest.fixture(scope="module")
def dropping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Appliance, int]]:
    """The demo appliance, its runtime stopped, and in its place on the backend port a stand-in
    that closes every POST's connection without an answer."""
    require_real_parts()
    root = tmp_path_factory.mktemp("resend")
    proxy_port, backend_port = free_port(), free_port()
    with running_manager(root / "manager") as manager:
        cfg = root / "appliance.toml"
        cfg.write_text(demo_config_text(proxy_port, backend_port))
        stop = ("b70-llamacpp.service", MONITOR_UNIT)
        with installed(manager, cfg, proxy_port, backend_port, stop=stop) as app:
            stand_in = subprocess.Popen(
                [sys.executable, "-m", "b70tools.dropping_runtime", str(backend_port)]
            )
            try:
                deadline = time.monotonic() + 30
                while posts(backend_port) is None:
                    assert time.monotonic() < deadline, "the stand-in never answered"
                    time.sleep(0.1)
                yield app, backend_port
            finally:
                stand_in.kill()
                stand_in.wait()
    shutil.rmtree(root, ignore_errors=True)


def posts(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/count", timeout=2) as answer:
            return int(json.load(answer)["posts"])
    except OSError:
        return None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_that_kills_its_runtime_reaches_it_three_times_at_most(
    dropping: tuple[Appliance, int], stream: bool
) -> None:
    import openai

    app, port = dropping
    before = posts(port)
    assert before is not None
    with pytest.raises(openai.APIError) as e:
        reply = app.client().chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "crash"}],
            max_tokens=4,
            stream=stream,
            timeout=120,
        )
        if stream:
            list(reply)
    reached = (posts(port) or 0) - before
    print(f"the request reached the runtime {reached} times; the client got {e.value!r}")
    assert reached == 1 + relay.REPLAYS == 3
