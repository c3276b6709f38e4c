"""Hours of use in minutes (scripts/soak): load through the proxy, a switch every M minutes, and
the memory and open files of every part of the appliance sampled all along.

Clients are those of b70tools/load_test.py (the OpenAI SDK, no retries, streaming and not). Every
`--sample-s` seconds the resident memory (RSS) and the open file descriptors of the proxy (its
master and workers), the monitor and the serving runtime are read from /proc through psutil.
Growth is the last sample against the first one taken after the warm-up (the first switch's
end, or `--warmup-s`); the runtime is replaced by every switch, so it is reported per sample,
not as growth. Exits 1 on a failed or truncated request, a failed switch, or when the proxy or
the monitor grew by `--max-growth` (10%) or more.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from b70tools import load_test

PARTS = {"proxy": "b70-litellm.service", "monitor": "b70-monitor.service"}


@dataclass
class Sample:
    at_s: float
    rss_bytes: dict[str, int]
    fds: dict[str, int]
    runtime: str | None


def tree_usage(pid: int | None) -> tuple[int, int]:
    """RSS and open fds of a process and its children, summed; (0, 0) when it is gone."""
    if not pid:
        return 0, 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    rss = fds = 0
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            fds += proc.num_fds()
        except psutil.Error:
            continue
    return rss, fds


def take_sample(config: Any, scope: Any, t0: float) -> Sample:
    from appliance.units import serving as units
    from appliance.units import systemd

    with systemd.connect(scope) as sd:
        pids = {part: sd.properties(unit).main_pid for part, unit in PARTS.items()}
        runtime = units.serving_runtime(config, sd)
        if runtime is not None:
            pids["runtime"] = sd.properties(config.runtimes[runtime].unit).main_pid
    rss, fds = {}, {}
    for part, pid in pids.items():
        rss[part], fds[part] = tree_usage(pid)
    return Sample(time.monotonic() - t0, rss, fds, runtime)


async def sampler(
    config: Any, scope: Any, t0: float, every_s: float, stop: asyncio.Event, out: list[Sample]
) -> None:
    while not stop.is_set():
        out.append(await asyncio.to_thread(take_sample, config, scope, t0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    from appliance import config as config_mod
    from appliance.layout import Scope, layout

    target, _ = load_test.target_from_config(args.config, args.user)
    scope = Scope.USER if args.user else Scope.SYSTEM
    config = config_mod.load(Path(args.config) if args.config else layout(scope).config)
    report = load_test.Report(args.clients, 0.0)
    t0 = time.monotonic()
    first = await load_test.switch(target, args.between[0])
    if not first.ok:
        raise SystemExit(f"soak: could not switch to {args.between[0]} to begin: {first.error}")
    stop = asyncio.Event()
    samples: list[Sample] = []
    tasks = [
        asyncio.create_task(load_test.client_loop(target, i, stop, report, args.max_tokens))
        for i in range(args.clients)
    ]
    tasks.append(asyncio.create_task(sampler(config, scope, t0, args.sample_s, stop, samples)))
    end = t0 + args.minutes * 60
    next_switch = time.monotonic() + args.switch_every * 60
    n = 0
    try:
        while time.monotonic() < end:
            await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))
            if time.monotonic() >= next_switch and time.monotonic() < end:
                n += 1
                runtime = args.between[n % 2]
                run = await load_test.switch(target, runtime)
                report.switches.append(run)
                how = "ok" if run.ok else f"FAILED: {run.error}"
                print(
                    f"soak: switch {n} to {runtime}: {run.end - run.start:.1f} s {how}",
                    file=sys.stderr,
                    flush=True,
                )
                next_switch = time.monotonic() + args.switch_every * 60
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return summarize(report, samples, args)


def summarize(
    report: load_test.Report, samples: list[Sample], args: argparse.Namespace
) -> dict[str, Any]:
    requests = report.summary()
    warm = [s for s in samples if s.at_s >= args.warmup_s] or samples
    growth: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        first, last = warm[0], warm[-1]
        before, after = first.rss_bytes[part], last.rss_bytes[part]
        growth[part] = {
            "rss_first_bytes": before,
            "rss_last_bytes": after,
            "rss_max_bytes": max(s.rss_bytes[part] for s in warm),
            "rss_growth": (after - before) / before if before else None,
            "fds_first": first.fds[part],
            "fds_last": last.fds[part],
        }
    runtime = [s.rss_bytes.get("runtime", 0) for s in warm]
    return {
        "minutes": args.minutes,
        "clients": args.clients,
        "requests": requests["all"],
        "switches": len(report.switches),
        "switches_failed": requests["switches_failed"],
        "errors": requests["errors"],
        "parts": growth,
        "runtime_rss_max_bytes": max(runtime) if runtime else None,
        "samples": [asdict(s) for s in samples],
    }


def render(doc: dict[str, Any]) -> str:
    r = doc["requests"]
    mib = 1024**2
    lines = [
        f"{doc['minutes']:g} min, {doc['clients']} clients, {doc['switches']} switches "
        f"({doc['switches_failed']} failed)",
        f"requests  sent {r['sent']}, succeeded {r['succeeded']}, failed {r['failed']}, "
        f"truncated {r['truncated']}, p50 {r['p50_s'] or 0:.3f} s, p99 {r['p99_s'] or 0:.3f} s",
        f"{'part':10}{'RSS first':>12}{'RSS last':>12}{'RSS max':>12}{'growth':>9}"
        f"{'fds first':>11}{'fds last':>10}",
    ]
    for part, g in doc["parts"].items():
        growth = "-" if g["rss_growth"] is None else f"{100 * g['rss_growth']:+.1f}%"
        first, last, peak = (
            g[k] / mib for k in ("rss_first_bytes", "rss_last_bytes", "rss_max_bytes")
        )
        lines.append(
            f"{part:10}{first:>8.0f} MiB{last:>8.0f} MiB{peak:>8.0f} MiB{growth:>9}"
            f"{g['fds_first']:>11}{g['fds_last']:>10}"
        )
    if doc["runtime_rss_max_bytes"]:
        lines.append(f"runtime   RSS at most {doc['runtime_rss_max_bytes'] / mib:.0f} MiB")
    for error, count in doc["errors"].items():
        lines.append(f"  {count} x {error}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--switch-every", type=float, default=10.0, metavar="MINUTES")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--between", nargs=2, default=["llamacpp", "vllm"], metavar="RUNTIME")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--max-growth", type=float, default=0.10)
    parser.add_argument("--config", help="the appliance's config (default: the installed one)")
    parser.add_argument("--user", action="store_true", help="the appliance of a user manager")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    doc = asyncio.run(soak(args))
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    r = doc["requests"]
    grown = [p for p, g in doc["parts"].items() if (g["rss_growth"] or 0) >= args.max_growth]
    if grown:
        print(
            f"soak: RSS grew by {args.max_growth:.0%} or more: {', '.join(grown)}", file=sys.stderr
        )
    return 1 if r["failed"] or r["truncated"] or doc["switches_failed"] or grown else 0


if __name__ == "__main__":
    sys.exit(main())
