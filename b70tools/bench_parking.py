"""Parking llama.cpp instead of stopping it (run through scripts/bench-parking): llama-server's
`--sleep-idle-seconds`, which frees the model and its cache when the server has been idle that
long and loads them again on the next request, against a cold start, on the demo's model.

Each round, with the demo's arguments for llama.cpp:
- cold: a new llama-server process; the time from its start to its /health answering 200, and
  to the first token of one streamed completion after that;
- parked: a server started with `--sleep-idle-seconds 1`, left idle until it sleeps (its /props
  says so), its RSS then, and the time from a request to its first token (the wake);
- warm: the same request again, awake, for scale.

Prints each figure's median over the rounds, and the RSS awake and asleep: on a B70 what sleep
gives back is the card's memory (the other runtime needs it), here the host's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import psutil

from b70tools.net import free_port

CACHE = Path(os.environ.get("B70_CACHE", Path.home() / ".cache" / "b70"))
LLAMA_SERVER = CACHE / "bin" / "llama-server"
GGUF = CACHE / "smollm2-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ARGS = ["-c", "2048", "--parallel", "2", "--threads", "2"]  # examples/demo.toml's
REQUEST = {"prompt": "Say hi.", "n_predict": 8, "stream": True, "temperature": 0}


def start(port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    argv = [str(LLAMA_SERVER), "-m", str(GGUF), "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen([*argv, *ARGS, *extra], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def wait_healthy(client: httpx.Client, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.01)
    raise SystemExit("llama-server did not answer /health in time")


def first_token_s(client: httpx.Client) -> float:
    """Seconds from sending a streamed completion to its first token."""
    start_t = time.monotonic()
    with client.stream("POST", "/completion", json=REQUEST) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:]).get("content"):
                return time.monotonic() - start_t
    raise SystemExit("the completion gave no token")


def sleeping(client: httpx.Client) -> bool:
    try:
        return bool(client.get("/props").json().get("is_sleeping"))
    except (httpx.TransportError, ValueError):
        return False


def cold_round() -> tuple[float, float]:
    port = free_port()
    started = time.monotonic()
    server = start(port, [])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            wait_healthy(client)
            healthy = time.monotonic() - started
            return healthy, healthy + first_token_s(client)
    finally:
        stop(server)


def parked_round() -> tuple[float, float, int, int]:
    port = free_port()
    server = start(port, ["--sleep-idle-seconds", "1"])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            wait_healthy(client)
            first_token_s(client)  # loaded and used once
            awake_rss = psutil.Process(server.pid).memory_info().rss
            deadline = time.monotonic() + 30
            while not sleeping(client):
                if time.monotonic() > deadline:
                    raise SystemExit("llama-server did not sleep within 30 s of idleness")
                time.sleep(0.1)
            asleep_rss = psutil.Process(server.pid).memory_info().rss
            wake = first_token_s(client)
            warm = first_token_s(client)
            return wake, warm, awake_rss, asleep_rss
    finally:
        stop(server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rounds", type=int, nargs="?", default=5)
    rounds = parser.parse_args().rounds
    if not (LLAMA_SERVER.exists() and GGUF.exists()):
        raise SystemExit("run scripts/fetch-llama-server and scripts/fetch-model first")
    cold = [cold_round() for _ in range(rounds)]
    parked = [parked_round() for _ in range(rounds)]

    def median(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.0f} ms"

    print(f"llama-server {' '.join(ARGS)}, SmolLM2-135M Q4_1, {rounds} rounds, medians:")
    print(f"  cold start to /health 200           {median([c[0] for c in cold])}")
    print(f"  cold start to the first token       {median([c[1] for c in cold])}")
    print(f"  parked (asleep): request to token   {median([p[0] for p in parked])}")
    print(f"  awake: request to token             {median([p[1] for p in parked])}")
    mib = 1 << 20
    print(f"  RSS awake {statistics.median([p[2] for p in parked]) / mib:.0f} MiB, "
          f"asleep {statistics.median([p[3] for p in parked]) / mib:.0f} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
