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

3. A door that costs nothing (`--parts burst`): against the paced source, a burst of 64 streams
   arriving at once and the same 64 started spread over one stream's length, through the proxy
   and direct, A B A B (tokens/s, times to first token, each request's way to the runtime and
   back); then one request at a time (what a request alone costs).
4. Where a burst's time goes (`--parts phases`): the proxy through b70tools.proxy_phases, which
   notes each step of each request inside the workers, and the collections that held a loop.

The client is raw asyncio HTTP/1.1 (keep-alive, chunked framing, counting `data:` events), so
that it costs little next to what it measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx

from appliance import config as config_mod
from appliance.layout import Layout, Scope
from appliance.units.render import proxy_argv, proxy_environment, render_proxy_config
from b70tools import proxy_phases, stream_client
from b70tools.demo_appliance import demo_text
from b70tools.net import free_port

REPO = Path(__file__).resolve().parent.parent

CLK_TCK = os.sysconf("SC_CLK_TCK")


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


def start_proxy(
    cfg: config_mod.Config, root: Path, key: str, phases: Path | None = None
) -> subprocess.Popen[bytes]:
    """The proxy as rendered; with `phases`, through b70tools.proxy_phases, noting there."""
    lay = Layout(Scope.USER, root / "units", root / "etc", root / "state")
    lay.etc_dir.mkdir(parents=True, exist_ok=True)
    lay.proxy_config.write_text(render_proxy_config(cfg, lay))
    env = {**os.environ, **proxy_environment(cfg, lay), "LITELLM_MASTER_KEY": key}
    log = open(root / f"proxy-{cfg.proxy.port}.log", "wb")  # noqa: SIM115 - lives with the process
    argv = proxy_argv(cfg, lay)
    if phases is not None:
        argv = [sys.executable, "-m", "b70tools.proxy_phases", str(phases), *argv]
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
    wait_http(f"http://127.0.0.1:{cfg.proxy.port}/health/liveliness", 120)
    return proc


def start_source(port: int, pace: float = 0) -> subprocess.Popen[bytes]:
    """The stand-in runtime (b70tools.stream_source), paced at `pace` tokens/s per stream."""
    argv = [sys.executable, "-m", "b70tools.stream_source", str(port)]
    source = subprocess.Popen([*argv, "--pace", str(pace)], start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/health", 30)
    return source


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


FAIR = [True]  # --no-fair: [proxy] fair = false
TLS: list[tuple[str, str] | None] = [None]  # [proxy] tls with this certificate and key (tls_costs)


def appliance_config(proxy_port: int, backend_port: int, workers: int) -> config_mod.Config:
    """examples/demo.toml with its proxy and its runtimes on these ports (demo_text)."""
    text = demo_text(proxy_port, backend_port, "~/.cache/b70")
    cfg = config_mod.parse(text, REPO / "examples" / "demo.toml")
    cert, key = TLS[0] or (None, None)
    proxy = replace(cfg.proxy, workers=workers, fair=FAIR[0], tls=cert is not None)
    return replace(cfg, proxy=replace(proxy, tls_cert=cert, tls_key=key))


# --- the two parts -----------------------------------------------------------------------------


def capacity(root: Path, workers_list: list[int], seconds: float) -> list[dict[str, float]]:
    source_port = free_port()
    source = start_source(source_port)
    rows = []
    try:
        direct = stream_client.steady(source_port, "none", "smollm2", 64, 256, 5)
        for workers in workers_list:
            cfg = appliance_config(free_port(), source_port, workers)
            key = "sk-bench-" + os.urandom(16).hex()
            proxy = start_proxy(cfg, root, key)
            try:
                stream_client.steady(
                    cfg.proxy.port, key, "smollm2", 64, 256, 3
                )  # warm every worker
                cpu0 = tree_cpu_s(proxy.pid)
                r = stream_client.steady(cfg.proxy.port, key, "smollm2", 64, 256, seconds)
                cpu = tree_cpu_s(proxy.pid) - cpu0
                # A source that answers at once: each request follows the last with no idle time.
                back_to_back = single(
                    (cfg.proxy.port, key), source_port, 100,
                    f"capacity: {workers} worker(s): one request at a time, back to back",
                )  # fmt: skip
            finally:
                stop(proxy)
            rows.append(
                {
                    "workers": workers,
                    "chunks_per_s": r["chunks"] / r["wall_s"],
                    "proxy_cpu_ms_per_chunk": 1000 * cpu / max(r["chunks"], 1),
                    "failed": r["failed"],
                    "direct_chunks_per_s": direct["chunks"] / direct["wall_s"],
                    "back_to_back_added_ms": back_to_back["added_ms"],
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
        stream_client.steady(cfg.proxy.port, key, "smollm2", 64, 64, 5)  # warm
        through, direct = [], []
        for i in range(rounds):
            a = stream_client.steady(cfg.proxy.port, key, "smollm2", 64, 256, seconds)
            b = stream_client.steady(backend_port, "none", "smollm2", 64, 256, seconds)
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
    source = start_source(port, total_tokens_per_s / 64)
    try:
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


# --- a burst, a stagger, and one request at a time ----------------------------------------------


def stamps(source_port: int) -> dict[str, dict[str, float]]:
    data: dict[str, dict[str, float]] = httpx.get(
        f"http://127.0.0.1:{source_port}/stamps", timeout=10
    ).json()
    return data


def arrivals_ab(
    proxy: tuple[int, str], source_port: int, starts: list[float], tokens: int, rounds: int,
    what: str,
) -> dict[str, object]:  # fmt: skip
    """The same arrivals through the proxy and straight to the source, alternated A B A B."""
    rows: dict[str, list[dict[str, float]]] = {"through": [], "direct": []}
    n = 0
    for i in range(rounds):
        for side, (port, key) in (("through", proxy), ("direct", (source_port, "none"))):
            stamps(source_port)  # forget the notes of earlier runs
            runs = stream_client.arrivals(port, key, "smollm2", tokens, starts, first_n=n)
            n += len(starts)
            row = {
                **stream_client.summarize(runs),
                **stream_client.phases(runs, stamps(source_port)),
            }
            rows[side].append(row)
            print(f"{what}: round {i + 1}, {side:7}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in row.items()), flush=True)  # fmt: skip
    med = {
        side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in rows.items()
    }
    t, d = med["through"], med["direct"]
    out = {
        "through": t,
        "direct": d,
        "ratio": t["tokens_per_s"] / d["tokens_per_s"],
        "ttft_median_added_ms": t["ttft_median_ms"] - d["ttft_median_ms"],
    }
    print(f"{what}: tokens/s through / direct {t['tokens_per_s']:.0f} / {d['tokens_per_s']:.0f} "
          f"= {out['ratio']:.3f}; median time to first token {t['ttft_median_ms']:.0f} ms / "
          f"{d['ttft_median_ms']:.0f} ms", flush=True)  # fmt: skip
    return out


def single(
    proxy: tuple[int, str], source_port: int, n: int, how: str = "one request at a time"
) -> dict[str, float]:
    """One request at a time, alternating through and direct: what one request costs."""
    through: list[float] = []
    direct: list[float] = []
    for i in range(n):
        for side, (port, key) in ((through, proxy), (direct, (source_port, "none"))):
            (run,) = stream_client.arrivals(port, key, "smollm2", 16, [0.0], first_n=10**6 + i)
            if run["first"] is not None:
                side.append(run["first"] - run["sent"])
    t, d = 1000 * statistics.median(through), 1000 * statistics.median(direct)
    print(f"{how}: time to first token through {t:.1f} ms, direct {d:.1f} ms: "
          f"{t - d:.1f} ms more", flush=True)  # fmt: skip
    return {"through_ttft_ms": t, "direct_ttft_ms": d, "added_ms": t - d}


@contextlib.contextmanager
def paced_proxy(
    root: Path, workers: int, stream_tokens_per_s: float, phases: Path | None = None
) -> Iterator[tuple[tuple[int, str], int]]:
    """The proxy (its port and key) in front of a source paced at `stream_tokens_per_s` per
    stream (and the source's port), both stopped however the block ends."""
    source_port = free_port()
    source = start_source(source_port, stream_tokens_per_s)
    try:
        cfg = appliance_config(free_port(), source_port, workers)
        key = "sk-bench-" + os.urandom(16).hex()
        proxy = start_proxy(cfg, root, key, phases)
        try:
            yield (cfg.proxy.port, key), source_port
        finally:
            stop(proxy)
    finally:
        stop(source)


def door_costs(root: Path, workers: int, rounds: int, total_tokens_per_s: float,
               streams: int = 64, tokens: int = 256) -> dict[str, object]:  # fmt: skip
    """The targets of a door that costs nothing, against a source paced like a B70 at 64 users:
    a burst of `streams` arriving at once, the same started spread over one stream's length,
    and one request at a time."""
    with paced_proxy(root, workers, total_tokens_per_s / streams) as (target, source_port):
        stream_client.arrivals(*target, "smollm2", 16, [0.0] * streams, first_n=-(10**6))  # warm
        stream_s = tokens * streams / total_tokens_per_s
        result: dict[str, object] = {"workers": workers}
        result["burst"] = arrivals_ab(target, source_port, [0.0] * streams, tokens, rounds,
                                      f"burst of {streams}")  # fmt: skip
        spread = [stream_s * i / streams for i in range(streams)]
        result["stagger"] = arrivals_ab(target, source_port, spread, tokens, rounds,
                                        f"{streams} spread over {stream_s:.1f} s")  # fmt: skip
        result["single"] = single(target, source_port, 30)
    return result


def tls_costs(root: Path, workers: int, rounds: int, total_tokens_per_s: float,
              streams: int = 64, tokens: int = 256) -> dict[str, object]:  # fmt: skip
    """TLS against plain HTTP on one proxy with [proxy] tls (one port speaks both), against the
    paced source: a burst of `streams` at once, each on a new connection (its handshake
    counted), alternated TLS, plain, direct; then one request at a time each way."""
    from appliance.deploy.certificate import make_self_signed

    cert, key_file = root / "tls.crt", root / "tls.key"
    pem, key_pem = make_self_signed((["localhost"], ["127.0.0.1"]))
    cert.write_text(pem)
    key_file.write_text(key_pem)
    trust = ssl.create_default_context(cafile=str(cert))
    TLS[0] = (str(cert), str(key_file))
    try:
        with paced_proxy(root, workers, total_tokens_per_s / streams) as ((port, key), source):
            for tls in (trust, None):  # warm every worker, both ways
                stream_client.arrivals(port, key, "smollm2", 16, [0.0] * streams,
                                       first_n=-(10**6), tls=tls)  # fmt: skip
            ways = {"tls": (port, key, trust), "plain": (port, key, None),
                    "direct": (source, "none", None)}  # fmt: skip
            rows: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
            singles: dict[str, list[float]] = {w: [] for w in ways}
            for i in range(rounds):
                for way, (p, k, tls) in ways.items():
                    runs = stream_client.arrivals(p, k, "smollm2", tokens, [0.0] * streams,
                                                  first_n=i * streams, tls=tls)  # fmt: skip
                    rows[way].append(stream_client.summarize(runs))
                    said = ", ".join(f"{k_} {v:.1f}" for k_, v in rows[way][-1].items())
                    print(f"tls: burst of {streams}, round {i + 1}, {way:6}: {said}", flush=True)
            for i in range(30):
                for way, (p, k, tls) in ways.items():
                    (run,) = stream_client.arrivals(p, k, "smollm2", 16, [0.0],
                                                    first_n=10**6 + i, tls=tls)  # fmt: skip
                    if run["first"] is not None:
                        singles[way].append(1000 * (run["first"] - run["sent"]))
    finally:
        TLS[0] = None
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in rows.items()}
    direct = med["direct"]["tokens_per_s"]
    out: dict[str, object] = {"workers": workers, "burst": med}
    for way in ("tls", "plain"):
        out[f"burst_ratio_{way}"] = med[way]["tokens_per_s"] / direct
        out[f"single_ttft_ms_{way}"] = statistics.median(singles[way])
    out["single_ttft_ms_direct"] = statistics.median(singles["direct"])
    print(
        f"tls: burst of {streams}: tokens/s through / direct, TLS {out['burst_ratio_tls']:.3f}, "
        f"plain {out['burst_ratio_plain']:.3f}; median time to first token TLS "
        f"{med['tls']['ttft_median_ms']:.0f} ms, plain {med['plain']['ttft_median_ms']:.0f} ms, "
        f"direct {med['direct']['ttft_median_ms']:.0f} ms; one request alone, time to first "
        f"token TLS {out['single_ttft_ms_tls']:.1f} ms, plain {out['single_ttft_ms_plain']:.1f} "
        f"ms, direct {out['single_ttft_ms_direct']:.1f} ms",
        flush=True,
    )
    return out


def door_phases(root: Path, workers: int, rounds: int, total_tokens_per_s: float,
                streams: int = 64, tokens: int = 256) -> list[dict[str, float]]:  # fmt: skip
    """Where a burst's time goes: the proxy through b70tools.proxy_phases (its steps noted in
    each worker), in front of the paced source, a burst of `streams` each round."""
    notes = root / "phases"
    out = []
    with paced_proxy(root, workers, total_tokens_per_s / streams, notes) as (target, source_port):
        for warm in range(2):  # every worker's first requests, and a burst after them
            stream_client.arrivals(*target, "smollm2", 16, [0.0] * streams,
                                   first_n=-(warm + 1) * 10**6)  # fmt: skip
        for i in range(rounds):
            stamps(source_port)
            proxy_phases.forget(notes)
            runs = stream_client.arrivals(*target, "smollm2", tokens, [0.0] * streams,
                                          first_n=i * streams)  # fmt: skip
            out.append(proxy_phases.split(runs, stamps(source_port), notes))
            print(f"phases of a burst of {streams}: round {i + 1}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in out[-1].items()), flush=True)  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
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
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["burst", "phases", "capacity", "paced", "llama", "tls"],
        default=["burst", "phases", "capacity", "paced", "llama", "tls"],
        help="burst: a burst, a stagger and single requests against the paced source; "
        "tls: the same burst and single requests over TLS and plain HTTP on one port; "
        "phases: where a burst's time goes, step by step inside the proxy's workers; "
        "capacity: chunks/s and CPU per chunk; paced, llama: the steady ratio at 64 streams",
    )
    parser.add_argument(
        "--no-fair", action="store_true", help="the proxy without its fair turns ([proxy] fair)"
    )
    args = parser.parse_args()
    FAIR[0] = not args.no_fair
    result: dict[str, object] = {}
    workers, parts = max(args.workers), set(args.parts)
    with tempfile.TemporaryDirectory(prefix="b70-bench-proxy-") as tmp:
        root = Path(tmp)
        if "burst" in parts:
            result["door"] = door_costs(root, workers, args.rounds, args.paced_tokens_per_s)
        if "tls" in parts:
            result["tls"] = tls_costs(root, workers, args.rounds, args.paced_tokens_per_s)
        if "phases" in parts:
            result["phases"] = door_phases(root, workers, args.rounds, args.paced_tokens_per_s)
        if "capacity" in parts:
            result["capacity"] = capacity(root, args.workers, args.seconds)
        if "paced" in parts:
            result["ratio_64_streams_paced"] = ratio_paced(
                root, workers, args.seconds, args.rounds, args.paced_tokens_per_s
            )
        if "llama" in parts:
            result["ratio_64_streams_llama"] = ratio_llama(
                root, Path(args.cache).expanduser(), workers, args.seconds, args.rounds
            )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
