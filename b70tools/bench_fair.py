"""Fairness between keys on one runtime (run through scripts/bench-fair).

The demo appliance under a private user manager, llama.cpp serving with `--parallel 2` (two
requests at once), two keys made with `b70ctl keys add`:
- heavy keeps STREAMS streamed requests open at all times (each HEAVY_TOKENS tokens with
  ignore_eos, then the next at once), through the OpenAI SDK;
- light sends one streamed request every GAP_S seconds (LIGHT_TOKENS tokens), and its time to
  first token (from its send to its first chunk with text) is taken.

Under each policy (POLICIES: the fair turns off, `[proxy] fair = false`, when the requests go to
llama-server as they come and it serves them first come, first served; on, as shipped; and on
with `keep_free = 1`; and, asked for, `direct`: no door, both keys straight to the runtime's
port, the floor under every policy), in one run, each phase for DURATION seconds: heavy alone
(once light's last request is 31 s old), light alone, then both. Heavy's tokens/s counts the
chunks its streams receive (one token each) after the first WARMUP_S seconds of a phase.
Printed: light's p50 and p95 time to first token and heavy's tokens/s, each against its figure
alone in the same policy; and each key's usage as `b70ctl usage` gives it for the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from b70tools.bench_demand import CACHE, percentile
from b70tools.demo_appliance import Demo, demo_appliance

STREAMS = 32
HEAVY_TOKENS = 64
LIGHT_TOKENS = 8
GAP_S = 2.0
WARMUP_S = 5.0
PROMPT = [{"role": "user", "content": "Write a long story about the sea."}]
MODEL = ["smollm2"]  # the name served: the demo's, or the B70 stand-in's (--b70)


@dataclass
class Phase:
    """What one phase saw."""

    ttft_s: list[float] = field(default_factory=list)  # light's
    heavy_tokens: int = 0  # heavy's chunks after the warm-up
    measured_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.heavy_tokens / self.measured_s if self.measured_s else None


DIRECT = [False]  # the policy "direct": to the runtime's port, no door


def client(demo: Demo, key: str) -> Any:
    import openai

    url = f"http://127.0.0.1:{demo.backend_port if DIRECT[0] else demo.proxy_port}/v1"
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)


def heavy_stream(api: Any, phase: Phase, start: float, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            stream = api.chat.completions.create(
                model=MODEL[0], messages=PROMPT, max_tokens=HEAVY_TOKENS, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                if stop.is_set():
                    stream.close()
                    return
                counted = time.monotonic() - start >= WARMUP_S
                if counted and chunk.choices and chunk.choices[0].delta.content:
                    phase.heavy_tokens += 1  # one thread's += at a time: the GIL's
        except Exception as e:  # counted and named
            phase.errors.append(f"heavy: {type(e).__name__}: {e}"[:200])
            time.sleep(0.5)


LIGHT_GONE_S = 31.0
LAST_LIGHT = [-LIGHT_GONE_S]  # when light last sent a request (time.monotonic)


def light_request(api: Any, phase: Phase) -> None:
    sent = LAST_LIGHT[0] = time.monotonic()
    try:
        stream = api.chat.completions.create(
            model=MODEL[0], messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=LIGHT_TOKENS, temperature=0, stream=True,
        )  # fmt: skip
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - sent
        if first is not None:
            phase.ttft_s.append(first)
    except Exception as e:
        phase.errors.append(f"light: {type(e).__name__}: {e}"[:200])


def run_phase(demo: Demo, keys: dict[str, str], heavy: bool, light: bool, seconds: float) -> Phase:
    phase = Phase()
    stop = threading.Event()
    start = time.monotonic()
    threads = []
    if heavy:
        api = client(demo, keys["heavy"])
        for _ in range(STREAMS):
            t = threading.Thread(target=heavy_stream, args=(api, phase, start, stop), daemon=True)
            t.start()
            threads.append(t)
    if light:
        api = client(demo, keys["light"])
        at = start + (WARMUP_S if heavy else 0.0)
        while at < start + seconds:
            time.sleep(max(0.0, at - time.monotonic()))
            t = threading.Thread(target=light_request, args=(api, phase), daemon=True)
            t.start()
            threads.append(t)
            at += GAP_S
    time.sleep(max(0.0, start + seconds - time.monotonic()))
    phase.measured_s = time.monotonic() - start - WARMUP_S if heavy else 0.0
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return phase


def b70ctl(demo: Demo, *args: str) -> dict[str, Any]:
    out = subprocess.run([*demo.b70ctl, *args, "--json"], env=demo.env, capture_output=True,
                         text=True, check=False)  # fmt: skip
    doc: dict[str, Any] = json.loads(out.stdout)
    if not doc.get("ok"):
        raise SystemExit(f"b70ctl {' '.join(args)}: {doc.get('error')}")
    return doc["result"]


# Each policy's lines in [proxy]
POLICIES = {
    "off": "fair = false",  # as they come: llama-server serves them first come, first served
    "on": "",  # the fair turns, as the appliance ships them
    "keep1": "keep_free = 1",  # ... with one place kept for a key with nothing running
    # No door at all: both keys' requests straight to the runtime's port, as they come. What
    # the runtime and this machine give, the floor under every policy of the door.
    "direct": "fair = false",
}
PROXY_KEYS = ("fair", "keep_free")


def set_policy(demo: Demo, policy: str) -> None:
    config = Path(demo.b70ctl[demo.b70ctl.index("--config") + 1])
    lines = [ln for ln in config.read_text().splitlines() if ln.split(" = ")[0] not in PROXY_KEYS]
    at = lines.index("[proxy]") + 1
    lines[at:at] = [POLICIES[policy]] if POLICIES[policy] else []
    config.write_text("\n".join(lines) + "\n")
    b70ctl(demo, "install")


def policy(demo: Demo, keys: dict[str, str], name: str, seconds: float, log: Any) -> dict[str, Any]:
    set_policy(demo, name)
    DIRECT[0] = name == "direct"
    # Heavy alone first, once light's last request is older than the door's ACTIVE_S (30 s):
    # alone, heavy gets what the door gives a key alone.
    time.sleep(max(0.0, LIGHT_GONE_S - (time.monotonic() - LAST_LIGHT[0])))
    heavy_alone = run_phase(demo, keys, heavy=True, light=False, seconds=seconds)
    log(f"{name}: heavy alone, {heavy_alone.tokens_per_s or 0:.1f} tokens/s")
    light_alone = run_phase(demo, keys, heavy=False, light=True, seconds=seconds)
    log(f"{name}: light alone, {len(light_alone.ttft_s)} requests")
    both = run_phase(demo, keys, heavy=True, light=True, seconds=seconds)
    log(f"{name}: both, {len(both.ttft_s)} light requests")
    alone_p50 = statistics.median(light_alone.ttft_s) if light_alone.ttft_s else None
    alone_p95 = percentile(light_alone.ttft_s, 95)
    p50 = statistics.median(both.ttft_s) if both.ttft_s else None
    p95 = percentile(both.ttft_s, 95)
    return {
        "policy": name,
        "light_alone_p50_s": alone_p50, "light_alone_p95_s": alone_p95,
        "light_p50_s": p50, "light_p95_s": p95, "light_requests": len(both.ttft_s),
        "light_p95_ratio": p95 / alone_p95 if p95 and alone_p95 else None,
        "heavy_alone_tokens_per_s": heavy_alone.tokens_per_s,
        "heavy_tokens_per_s": both.tokens_per_s,
        "heavy_ratio": (both.tokens_per_s / heavy_alone.tokens_per_s
                        if both.tokens_per_s and heavy_alone.tokens_per_s else None),
        "errors": light_alone.errors + heavy_alone.errors + both.errors,
    }  # fmt: skip


def show(figures: list[dict[str, Any]], usage: list[dict[str, Any]]) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [
        "policy  light TTFT p50 / alone (s)  light TTFT p95 / alone (s)  p95 ratio  "
        "heavy tok/s / alone  ratio  errors"
    ]
    for f in figures:
        light = [
            f"{s(f[a])} / {s(f[b])}"
            for a, b in (("light_p50_s", "light_alone_p50_s"), ("light_p95_s", "light_alone_p95_s"))
        ]
        heavy = f"{s(f['heavy_tokens_per_s'])} / {s(f['heavy_alone_tokens_per_s'])}"
        lines.append(
            f"{f['policy']:<6}  {light[0]:>26}  {light[1]:>26}  "
            f"{s(f['light_p95_ratio']):>9}  {heavy:>19}  {s(f['heavy_ratio']):>5}  "
            f"{len(f['errors']):>6}"
        )
    lines.append("targets with fair turns on: light p95 ratio <= 2, heavy ratio >= 0.95")
    lines.append(
        "policies: "
        + "; ".join(
            f"{k}: "
            + (
                "no door, to the runtime's port"
                if k == "direct"
                else f"[proxy] {v or 'as shipped'}"
            )
            for k, v in POLICIES.items()
        )
    )
    lines.append("usage for the run (b70ctl usage):")
    lines += [
        f"  {u['key']:<8} requests {u['requests']:>5}  tokens in {u['in']:>7}  out {u['out']:>7}  "
        f"queued {u['queued_s']:>8.1f} s  429s {u['limited']}"
        for u in usage
    ]
    return "\n".join(lines)


B70_MODEL = "qwen3.6-35b-a3b"


@contextmanager
def b70_standin(scale: float) -> Iterator[Demo]:
    """examples/b70.toml's appliance on the B70 stand-in (b70tools.b70_appliance), on a fixture
    card, under a private user manager; its start-up times scaled by `scale`."""
    import shutil
    import tempfile
    import tomllib

    from b70tools import b70_engine, gpu_trees
    from b70tools.b70_appliance import standin_text

    where = Path(tempfile.mkdtemp(prefix="bench-fair-b70-", dir=CACHE))
    tree = gpu_trees.healthy_host(where / "sysroot", [gpu_trees.B70])
    driver = b70_engine.Driver(tree, release_s=1.0, listen=True)
    driver.start()

    def edit(text: str) -> str:
        doc = tomllib.loads(text)
        proxy, backend, monitor = (
            doc["proxy"]["port"],
            doc["backend"]["port"],
            doc["monitor"]["port"],
        )
        return standin_text(proxy, backend, monitor, where / "models", scale)

    env = {"B70_SYSROOT": str(tree), "B70_STANDIN_DRIVER": driver.address}
    try:
        with demo_appliance(CACHE, prefix="b70-fair-b70.", rewrite=edit, manager_env=env) as demo:
            yield demo
    finally:
        driver.stop()
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    global STREAMS, GAP_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of each phase")
    parser.add_argument("--streams", type=int, default=STREAMS, help="heavy's open streams")
    parser.add_argument("--gap", type=float, default=GAP_S, help="seconds between light's")
    parser.add_argument("--policies", default="off,on,keep1", help="of " + ",".join(POLICIES))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--b70", action="store_true",
        help="on the B70 stand-in's vLLM (examples/b70.toml: 64 places, a B70's time per token)",
    )  # fmt: skip
    parser.add_argument("--b70-scale", type=float, default=0.05, help="the stand-in's start time")
    parser.add_argument(
        "--crowd", type=int, default=0,
        help="instead: a batch key keeping this many requests waiting, beside a light key "
        "(b70tools/bench_crowd.py; --policies of on,keep1,share,direct)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.crowd:
        from b70tools import bench_crowd

        chosen = args.policies.split(",") if args.policies != "off,on,keep1" else ["on", "keep1"]
        if any(p not in bench_crowd.POLICIES for p in chosen):
            named = ", ".join(bench_crowd.POLICIES)
            raise SystemExit(f"--policies with --crowd: a list of {named}")
        b70 = args.b70_scale if args.b70 else None
        bench_crowd.crowd_main(args.crowd, args.duration, chosen, args.json, b70)
        return
    STREAMS, GAP_S = args.streams, args.gap
    chosen = args.policies.split(",")
    if any(p not in POLICIES for p in chosen):
        raise SystemExit(f"--policies: a list of {', '.join(POLICIES)}")
    log = lambda m: print(m, flush=True)  # noqa: E731
    appliance = (
        b70_standin(args.b70_scale) if args.b70 else demo_appliance(CACHE, prefix="b70-fair.")
    )
    with appliance as demo:
        if args.b70:
            b70ctl(demo, "switch", "vllm")  # --max-num-seqs 64: 64 places
            MODEL[0] = B70_MODEL
        keys = {name: b70ctl(demo, "keys", "add", name)["key"] for name in ("heavy", "light")}
        started = time.time()
        figures = [policy(demo, keys, p, args.duration, log) for p in chosen]
        since = f"{max(1, int(time.time() - started) + 1)}s"
        usage = [u for u in b70ctl(demo, "usage", "--since", since)["keys"] if u["key"] != "master"]
    print(show(figures, usage))
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "usage": usage}, indent=1))


if __name__ == "__main__":
    main()
