"""The B70 stand-in engine (b70tools.b70_engine) behaves as the B70 logs say: vLLM's start-up
lines from the plan, at a B70's times (scaled), the memory the plan says on a fixture B70, 64
requests at once at the seed's time per token, vLLM's metric names, a real failure's lines, and
memory the driver frees after the process has gone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.host import failures, gpu
from appliance.measure import capacity, serveflags, startlog
from b70tools import b70_engine
from b70tools import gpu_trees as t
from b70tools.net import free_port

B70 = Path(__file__).parent / "fixtures" / "b70"
SEED = ["--quantization", "gptq", "--dtype", "float16", "--kv-cache-dtype", "fp8",
        "--max-model-len", "16384", "--gpu-memory-utilization", "0.82", "--max-num-seqs", "64",
        "--max-num-batched-tokens", "8192", "--no-enable-prefix-caching",
        "--mamba-ssm-cache-dtype", "float16"]  # fmt: skip


class Engine:
    def __init__(self, tmp: Path, kind: str, args: list[str], **env: str) -> None:
        self.root = t.build(tmp / "root", [t.Card(t.B70)], [])
        self.port = free_port()
        self.out = tmp / f"{kind}.log"
        argv = [sys.executable, "-m", "b70tools.b70_engine", kind, *args,
                "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        full = {**os.environ, "B70_SYSROOT": str(self.root), "B70_STANDIN_SCALE": "0.01", **env}
        with self.out.open("w") as f:
            self.proc = subprocess.Popen(argv, env=full, stdout=f, stderr=subprocess.STDOUT,
                                         cwd=Path(__file__).parent.parent)  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self, timeout_s: float = 30) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.out.read_text()
            time.sleep(0.05)
        raise AssertionError(f"not ready in {timeout_s} s: {self.out.read_text()}")

    def held(self) -> int:
        (device,) = gpu.snapshot(self.root).devices
        return sum(n for h, n in device.holders if h.pid == self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for e in started:
        e.stop()


def model_dir(tmp: Path) -> Path:
    d = tmp / "model"
    d.mkdir(exist_ok=True)
    shutil.copy(B70 / "Qwen-Qwen3.6-35B-A3B.json", d / "config.json")
    return d


def test_vllm_starts_as_the_plan_says_holds_its_memory_and_serves_64_at_once(
    tmp_path: Path, engines: list[Engine]
) -> None:
    e = Engine(tmp_path, "vllm", ["--model", str(model_dir(tmp_path)), *SEED,
                                   "--served-model-name", "qwen"])  # fmt: skip
    engines.append(e)
    took = e.ready()
    cfg = json.loads((B70 / "Qwen-Qwen3.6-35B-A3B.json").read_text())
    plan = capacity.plan(cfg, serveflags.parse(SEED))
    log = e.out.read_text()
    for line in startlog.plan_log(plan)[1:]:
        assert line in log
    assert f"Model loading took {startlog.gib2(plan.weight_bytes_per_card)} GiB memory" in log
    # 15 s of process, 1.15 s a GiB of weights and 228 s of engine, at 0.01
    expected = (15 + plan.weight_bytes_per_card / 2**30 * b70_engine.LOAD_S_PER_GIB + 228.37) * 0.01
    assert took >= expected * 0.9
    assert e.held() == int(0.82 * capacity.B70_TOTAL_BYTES) // 1024 * 1024

    async def burst() -> tuple[str, list[int]]:
        async with httpx.AsyncClient(timeout=60) as c:
            body = {
                "model": "qwen",
                "max_tokens": 20,
                "messages": [{"role": "user", "content": "hi"}],
            }
            tasks = [asyncio.ensure_future(c.post(e.url + "/v1/chat/completions", json=body))
                     for _ in range(80)]  # fmt: skip
            await asyncio.sleep(0.3)
            metrics = (await c.get(e.url + "/metrics")).text
            done = await asyncio.gather(*tasks)
            return metrics, [r.json()["usage"]["completion_tokens"] for r in done]

    metrics, tokens = asyncio.run(burst())
    assert 'vllm:num_requests_running{engine="0"} 64' in metrics
    assert 'vllm:num_requests_waiting{engine="0"} 16' in metrics
    assert "vllm:cache_config_info{" in metrics and 'block_size="1088"' in metrics
    assert tokens == [20] * 80

    driver = b70_engine.Driver(e.root, release_s=0.3)
    e.stop()
    driver.sweep()
    baseline = t.Card(t.B70).vram_used
    assert gpu.snapshot(e.root).devices[0].used_bytes == baseline + e.held() > baseline, (
        "held until the driver frees it"
    )
    time.sleep(0.4)
    driver.sweep()
    (device,) = gpu.snapshot(e.root).devices
    assert device.holders == [] and device.used_bytes == baseline


def test_a_real_failure_prints_its_lines_and_exits(tmp_path: Path, engines: list[Engine]) -> None:
    e = Engine(tmp_path, "vllm", ["--model", str(model_dir(tmp_path)), *SEED],
               B70_STANDIN_FAIL="no-kv-cache-memory")  # fmt: skip
    engines.append(e)
    assert e.proc.wait(30) == 1
    out = e.out.read_text()
    for line in failures.by_name("no-kv-cache-memory").sample:
        assert line in out
    found = failures.diagnose(out)
    assert found is not None and found[0].name == "no-kv-cache-memory"


def test_llama_server_says_it_is_loading_then_serves_one_slot(
    tmp_path: Path, engines: list[Engine]
) -> None:
    gguf = tmp_path / "q.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 1024)
    e = Engine(tmp_path, "llamacpp", ["-m", str(gguf), "-c", "131072", "--parallel", "1"],
               B70_STANDIN_LLAMA_GIB="20", B70_STANDIN_SCALE="0.1")  # fmt: skip
    engines.append(e)
    seen = set()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20:
        with contextlib.suppress(httpx.HTTPError):
            seen.add(httpx.get(e.url + "/health", timeout=2).status_code)
        if 200 in seen:
            break
        time.sleep(0.05)
    assert seen == {503, 200}
    assert e.held() == 20 * 2**30 + 131072 * 10 * 1024
