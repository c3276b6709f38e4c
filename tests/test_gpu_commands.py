"""`b70ctl gpu` and the waits for GPU memory on fixture trees in the kernel's formats."""

import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from appliance.host.gpu import fit
from b70tools import gpu_trees as t
from b70tools.net import free_port
from tests.conftest import B70CTL

GIB = t.GIB


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return tmp_path / "root"


def b70ctl(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([B70CTL, *args], capture_output=True, text=True, timeout=timeout)


def test_gpu_command_lists_devices_and_holders(tree: Path) -> None:
    t.build(tree, [t.Card(t.B70, vram_used=42 * GIB // 2)], [t.llama_server(), t.foreign()])
    out = b70ctl("gpu", "--root", str(tree))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == [
        "DEVICE",
        "NAME",
        "DRIVER",
        "RENDER",
        "TOTAL",
        "USED",
        "FREE",
        "SOURCE",
    ]
    assert lines[1].split() == [
        t.B70,
        "Intel",
        "Arc",
        "Pro",
        "B70",
        "xe",
        "renderD128",
        "32.0",
        "GiB",
        "21.0",
        "GiB",
        "11.0",
        "GiB",
        "xe-query",
    ]
    assert (
        "4242  b70-llamacpp.service  0000:03:00.0  22.0 GiB  /opt/llama.cpp/bin/llama-server"
        in out.stdout
    )
    assert "5151  session-3.scope" in out.stdout
    doc = json.loads(b70ctl("gpu", "--root", str(tree), "--json").stdout)
    (dev,) = doc["result"]["devices"]
    assert dev["device_id"] == "0xe223" and dev["total_bytes"] == 32 * GIB
    assert {h["pid"]: h["vram_bytes"] for h in dev["holders"]} == {4242: 22 * GIB, 5151: 20 * GIB}


def test_wait_free_passes_at_once_without_a_gpu(tmp_path: Path) -> None:
    out = b70ctl("gpu", "wait-free", "--root", str(tmp_path), "--need-gib", "24", "--timeout", "5")
    assert out.returncode == 0
    assert "no Intel GPU found: nothing to wait for" in out.stderr


def test_wait_free_waits_until_the_old_runtime_lets_go(tree: Path) -> None:
    card = t.Card(t.B70, vram_used=22 * GIB)
    t.build(tree, [card], [t.llama_server()])

    def release() -> None:
        time.sleep(0.4)  # a poll or more (every 0.25 s) while the process holds the memory
        shutil.rmtree(tree / "proc" / "4242")
        time.sleep(0.4)  # the driver frees the memory a little after the process is gone
        card.vram_used = 300 * 1024**2
        (tree / "dev" / "dri" / "renderD128").write_bytes(t.mem_regions_reply(card))

    releaser = threading.Thread(target=release)
    releaser.start()
    started = time.monotonic()
    out = b70ctl(
        "gpu",
        "wait-free",
        "--root",
        str(tree),
        "--need-gib",
        "24",
        "--unit",
        "b70-vllm.service",
        "--timeout",
        "20",
    )
    took = time.monotonic() - started
    releaser.join()
    assert out.returncode == 0, out.stderr
    assert took >= 0.8
    messages = out.stderr.splitlines()
    assert messages[0].startswith("GPU memory: waiting: still held by pid 4242")
    assert messages[1].startswith(
        "GPU memory: waiting: 0000:03:00.0: 10.0 GiB free of 32.0 GiB, need 24.0 GiB"
    )
    assert messages[-1].startswith(
        "GPU memory: 0000:03:00.0: 31.7 GiB free of 32.0 GiB, need 24.0 GiB (after"
    )


def test_wait_start_counts_polls(tree: Path) -> None:
    t.build(tree, [t.Card(t.B70, vram_used=22 * GIB)], [t.llama_server()])
    card = t.Card(t.B70)
    polls: list[float] = []
    now = [0.0]

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        now[0] += seconds
        if len(polls) == 3:  # memory released after the third poll
            shutil.rmtree(tree / "proc" / "4242")
            (tree / "dev" / "dri" / "renderD128").write_bytes(t.mem_regions_reply(card))

    logged: list[str] = []
    verdict = fit.wait_start(
        tree,
        ("auto",),
        24 * GIB,
        "b70-vllm.service",
        60,
        logged.append,
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert verdict.ok
    assert polls == [0.25, 0.25, 0.25]
    assert (
        logged[-1]
        == "GPU memory: 0000:03:00.0: 31.7 GiB free of 32.0 GiB, need 24.0 GiB (after 0.8 s)"
    )


def test_wait_free_times_out_naming_the_holder(tree: Path) -> None:
    t.build(tree, [t.Card(t.B70, vram_used=20 * GIB)], [t.foreign()])
    started = time.monotonic()
    out = b70ctl("gpu", "wait-free", "--root", str(tree), "--need-gib", "24", "--timeout", "0.3")
    assert out.returncode == 1
    assert time.monotonic() - started >= 0.3
    assert (
        "error: GPU memory was not free within 0.3 s: 0000:03:00.0: 12.0 GiB free of 32.0 GiB, need 24.0 GiB; "
        "held by pid 5151 (python3 train.py --epochs 3) in session-3.scope: 20.0 GiB"
    ) in out.stderr
    assert "hint: `b70ctl gpu` shows who holds it" in out.stderr


def test_the_units_guard_waits_for_gpu_memory_before_it_looks_at_the_port(tree: Path) -> None:
    """`b70ctl unit pre`, every runtime unit's ExecStartPre=, does what `gpu wait-free` does
    first, in the same process; the port comes second."""
    t.build(tree, [t.Card(t.B70, vram_used=20 * GIB)], [t.foreign()])
    guard = ["unit", "pre", "--root", str(tree), "--device", "auto"]
    out = b70ctl(
        *guard, "--port", str(free_port()), "--need-bytes", str(24 * GIB), "--gpu-timeout", "0"
    )
    assert out.returncode == 1
    assert "error: GPU memory was not free within 0 s: 0000:03:00.0: 12.0 GiB free" in out.stderr
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        fits = b70ctl(*guard, "--port", port, "--need-bytes", str(GIB), "--wait", "0")
    assert fits.returncode == 1
    assert "GPU memory: 0000:03:00.0: 12.0 GiB free" in fits.stderr, (
        "the GPU-memory guard came first"
    )
    assert f"error: port {port} is in use by" in fits.stderr


def test_level_zero_sysman_is_optional_and_says_why_it_is_absent() -> None:
    from appliance.host.gpu.sysman import read_sysman

    result = read_sysman()
    # This machine has no Intel GPU: whether pyzes, the loader or a driver is missing, the
    # reader answers with a reason, never with made-up memory or an exception.
    assert result.memory == {}
    assert result.unavailable
    assert any(w in result.unavailable for w in ("pyzes", "Level Zero"))
