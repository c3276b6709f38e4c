"""Is the proxy ever the bottleneck? (run through scripts/bench-proxy)

The proxy runs exactly as the appliance renders it (litellm.yaml with the hold hook and the key
check, the unit's environment and command line), only on other ports and without systemd.

1. Capacity: a stream source that answers as fast as it can (8 SSE events per write) stands in
   for the runtime. 64 streams of 256 tokens through the proxy, for each worker count asked for:
   streamed chunks per second, and the proxy's CPU per chunk (all its processes, from /proc).
2. Ratio at 64 streams: 64 streams through the proxy and 64 straight to the runtime, alternated
   A B A B: tokens per second of each, and the ratio. Twice: against a source paced like a B70
   serving 64 users (1500 tokens/s in all, one event per write), and against llama-server with
   the demo model and 64 slots, which shares this machine's two cores with the proxy (on a B70
   the GPU generates, so the proxy's CPU takes nothing from it).

The client is raw asyncio HTTP/1.1 (keep-alive, chunked framing, counting `data:` events), so
that it costs little next to what it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from appliance import config as config_mod
from appliance.layout import Layout, Scope
from appliance.render import proxy_argv, proxy_environment, render_proxy_config
from b70tools.net import free_port

REPO = Path(__file__).resolve().parent.parent

CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the fast stream source --------------------------------------------------------------------


def sse_response(path: str, request: dict, per_write: int) -> list[bytes]:
    """The HTTP chunks of one streamed answer of max_tokens one-token events."""
    n = int(request.get("max_tokens") or 16)
    model = json.dumps(request.get("model", "m"))
    if "chat" in path:
        head = f'{{"id":"c","object":"chat.completion.chunk","created":1,"model":{model},'
        event = f'data: {head}"choices":[{{"index":0,"delta":{{"content":"x"}}}}]}}\n\n'
        last = f'data: {head}"choices":[{{"index":0,"delta":{{}},"finish_reason":"length"}}]}}\n\n'
    else:
        head = f'{{"id":"c","object":"text_completion","created":1,"model":{model},'
        event = f'data: {head}"choices":[{{"index":0,"text":"x"}}]}}\n\n'
        last = f'data: {head}"choices":[{{"index":0,"text":"","finish_reason":"length"}}]}}\n\n'
    writes = []
    for start in range(0, n, per_write):
        payload = (event * min(per_write, n - start)).encode()
        writes.append(b"%x\r\n%s\r\n" % (len(payload), payload))
    tail = (last + "data: [DONE]\n\n").encode()
    writes.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
    return writes


async def serve_source(port: int, per_write: int = 8, stream_tokens_per_s: float = 0) -> None:
    """Answer as fast as possible, or, paced, at `stream_tokens_per_s` per stream."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                request_line, *lines = head.split("\r\n")
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines)
                    if v
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                method, path = request_line.split(" ")[:2]
                if method == "GET":
                    text = b'{"status":"ok"}'
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(text), text)
                    )
                else:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n"
                    )
                    for chunk in sse_response(path, json.loads(body or b"{}"), per_write):
                        writer.write(chunk)
                        await writer.drain()
                        if stream_tokens_per_s:
                            await asyncio.sleep(per_write / stream_tokens_per_s)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# --- the lean client ---------------------------------------------------------------------------


async def stream_worker(
    port: int, key: str, model: str, tokens: int, deadline: float, totals: dict[str, int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(
        {
            "model": model,
            "stream": True,
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
        }
    ).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer %s\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (key.encode(), len(body), body)
    )
    try:
        while time.monotonic() < deadline:
            writer.write(request)
            status = await reader.readline()
            chunked, length = False, 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "transfer-encoding" and "chunked" in value.lower():
                    chunked = True
                elif name.lower() == "content-length":
                    length = int(value)
            events, done = 0, False
            if chunked:
                while size := int((await reader.readline()).split(b";")[0], 16):
                    data = await reader.readexactly(size + 2)
                    events += data.count(b"data: ")
                    done = done or b"data: [DONE]" in data
                await reader.readline()
            else:
                await reader.readexactly(length)
            ok = b" 200 " in status and done
            totals["chunks"] += max(events - 2, 0) if ok else 0  # less the last and [DONE]
            totals["ok" if ok else "failed"] += 1
    finally:
        writer.close()


async def measure(port: int, key: str, model: str, streams: int, tokens: int, seconds: float):
    totals = {"chunks": 0, "ok": 0, "failed": 0}
    start = time.monotonic()
    await asyncio.gather(
        *(stream_worker(port, key, model, tokens, start + seconds, totals) for _ in range(streams))
    )
    totals["wall_s"] = time.monotonic() - start  # type: ignore[assignment]
    return totals


def run_client(port: int, key: str, model: str, streams: int, tokens: int, seconds: float):
    return asyncio.run(measure(port, key, model, streams, tokens, seconds))


# --- processes ---------------------------------------------------------------------------------


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its descendants, alive now."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo += [int(c) for c in children]
        except (OSError, IndexError, ValueError):
            continue
    return total


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer 200 within {timeout_s:.0f} s")


def start_proxy(cfg: config_mod.Config, root: Path, key: str) -> subprocess.Popen[bytes]:
    lay = Layout(Scope.USER, root / "units", root / "etc", root / "state")
    lay.etc_dir.mkdir(parents=True, exist_ok=True)
    lay.proxy_config.write_text(render_proxy_config(cfg, lay))
    env = {**os.environ, **proxy_environment(cfg, lay), "LITELLM_MASTER_KEY": key}
    log = open(root / f"proxy-{cfg.proxy.port}.log", "wb")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(
        proxy_argv(cfg, lay), env=env, stdout=log, stderr=log, start_new_session=True
    )
    wait_http(f"http://127.0.0.1:{cfg.proxy.port}/health/liveliness", 120)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def appliance_config(proxy_port: int, backend_port: int, workers: int) -> config_mod.Config:
    text = (REPO / "examples" / "demo.toml").read_text()
    cfg = config_mod.parse(text, REPO / "examples" / "demo.toml")
    proxy = replace(cfg.proxy, port=proxy_port, workers=workers)
    return replace(cfg, proxy=proxy, backend=replace(cfg.backend, port=backend_port))


# --- the two parts -----------------------------------------------------------------------------


def capacity(root: Path, workers_list: list[int], seconds: float) -> list[dict[str, float]]:
    source_port = free_port()
    source = subprocess.Popen(
        [sys.executable, "-m", "b70tools.bench_proxy", "--serve-source", str(source_port)],
        start_new_session=True,
    )
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{source_port}/health", 30)
        direct = run_client(source_port, "none", "smollm2", 64, 256, 5)
        for workers in workers_list:
            cfg = appliance_config(free_port(), source_port, workers)
            key = "sk-bench-" + os.urandom(16).hex()
            proxy = start_proxy(cfg, root, key)
            try:
                run_client(cfg.proxy.port, key, "smollm2", 64, 256, 3)  # warm every worker
                cpu0 = tree_cpu_s(proxy.pid)
                r = run_client(cfg.proxy.port, key, "smollm2", 64, 256, seconds)
                cpu = tree_cpu_s(proxy.pid) - cpu0
            finally:
                stop(proxy)
            rows.append(
                {
                    "workers": workers,
                    "chunks_per_s": r["chunks"] / r["wall_s"],
                    "proxy_cpu_ms_per_chunk": 1000 * cpu / max(r["chunks"], 1),
                    "failed": r["failed"],
                    "direct_chunks_per_s": direct["chunks"] / direct["wall_s"],
                }
            )
            print(
                f"capacity: {workers} worker(s): {rows[-1]['chunks_per_s']:7.0f} chunks/s, "
                f"{rows[-1]['proxy_cpu_ms_per_chunk']:.3f} ms proxy CPU per chunk, "
                f"{r['failed']} failed (source alone: {rows[-1]['direct_chunks_per_s']:.0f}/s)",
                flush=True,
            )
    finally:
        stop(source)
    return rows


def ratio(root: Path, backend_port: int, workers: int, seconds: float, rounds: int, what: str):
    """64 streams through the proxy and 64 straight to the backend, alternated A B A B."""
    cfg = appliance_config(free_port(), backend_port, workers)
    key = "sk-bench-" + os.urandom(16).hex()
    proxy = start_proxy(cfg, root, key)
    try:
        run_client(cfg.proxy.port, key, "smollm2", 64, 64, 5)  # warm
        through, direct = [], []
        for i in range(rounds):
            a = run_client(cfg.proxy.port, key, "smollm2", 64, 256, seconds)
            b = run_client(backend_port, "none", "smollm2", 64, 256, seconds)
            through.append(a["chunks"] / a["wall_s"])
            direct.append(b["chunks"] / b["wall_s"])
            print(
                f"ratio ({what}): round {i + 1}: through the proxy {through[-1]:.0f} tokens/s "
                f"({a['failed']} failed), direct {direct[-1]:.0f} tokens/s ({b['failed']} failed)",
                flush=True,
            )
    finally:
        stop(proxy)
    t, d = statistics.median(through), statistics.median(direct)
    return {"through_tokens_per_s": t, "direct_tokens_per_s": d, "ratio": t / d}


def ratio_paced(root: Path, workers: int, seconds: float, rounds: int, total_tokens_per_s: float):
    """A source paced like a B70 at 64 users: each stream gets 1/64 of the total rate."""
    port = free_port()
    argv = [sys.executable, "-m", "b70tools.bench_proxy", "--serve-source", str(port)]
    source = subprocess.Popen(
        [*argv, "--pace", str(total_tokens_per_s / 64)], start_new_session=True
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30)
        what = f"source paced at {total_tokens_per_s:g} tokens/s over 64 streams"
        return ratio(root, port, workers, seconds, rounds, what)
    finally:
        stop(source)


def ratio_llama(root: Path, cache: Path, workers: int, seconds: float, rounds: int):
    """llama-server with the demo model and 64 slots, sharing this machine's cores."""
    port = free_port()
    model = cache / "smollm2-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    argv = [str(cache / "bin" / "llama-server"), "--model", str(model), "--alias", "smollm2"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--parallel", "64"]
    argv += ["-c", str(64 * 384), "--threads", "2", "--metrics"]
    llama = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120)
        return ratio(root, port, workers, seconds, rounds, "llama-server, 64 slots, CPU")
    finally:
        stop(llama)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--serve-source", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pace", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--paced-tokens-per-s",
        type=float,
        default=1500,
        help="total rate of the paced source (a B70 at 64 users: 1420-1510)",
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", default=os.environ.get("B70_CACHE", "~/.cache/b70"))
    parser.add_argument("--skip-ratio", action="store_true")
    args = parser.parse_args()
    if args.serve_source:
        asyncio.run(serve_source(args.serve_source, 1 if args.pace else 8, args.pace))
        return 0
    with tempfile.TemporaryDirectory(prefix="b70-bench-proxy-") as tmp:
        rows = capacity(Path(tmp), args.workers, args.seconds)
        result: dict[str, object] = {"capacity": rows}
        if not args.skip_ratio:
            workers, root = max(args.workers), Path(tmp)
            result["ratio_64_streams_paced"] = ratio_paced(
                root, workers, args.seconds, args.rounds, args.paced_tokens_per_s
            )
            result["ratio_64_streams_llama"] = ratio_llama(
                root, Path(args.cache).expanduser(), workers, args.seconds, args.rounds
            )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
