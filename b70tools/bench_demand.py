"""Switching on demand in three orders on the same traces: strict first come, first served,
the collated order llama-swap ships now, and the appliance's policy (run through
scripts/bench-demand).

The demo appliance under a private user manager, its llama.cpp serving `smollm2` and its vLLM
serving `smollm2-vllm` on a port of its own, both on the one CPU "card", with `[switching]
on_demand`. The trace, from a seed: for each model, Poisson arrivals (a mean gap per model), one
arrival in ten a burst of 3 to 6 requests at once, for DURATION seconds
(b70tools.demand_sim.trace). Each request is a streamed OpenAI SDK chat completion (16 tokens at
most, temperature 0), sent at its time by a thread of its own; its latency runs from its send to
its last chunk.

Each trace is replayed in each order, on a new appliance each time (llama.cpp serving at the
start), the orders taking turns at going first from one seed to the next (the second seed runs
them in reverse), so that none always runs on a warm machine:
- fcfs: `[switching] order = "fcfs"`, strict first come, first served: a request for the other
  runtime swaps as soon as the requests in flight end, and the requests that came after it wait
  for their turn, whichever model they ask for (llama-swap's order until its queue collated);
- collated: `order = "collated"`, as llama-swap serves now: the runtime that swapped in takes
  every request waiting for it and swaps away only when none is left, to the runtime of the
  oldest request waiting for another;
- policy: the appliance's default order.
Every order holds a request up to 900 s (`[proxy] hold_s`); a request that gets an error is
failed, a stream that ends without its finish reason is cut.

With `--b70 SCALE` the appliance is examples/b70.toml's on the B70 stand-in
(b70tools.b70_engine, b70tools.b70_appliance) on a fixture B70: llama.cpp serving `qwen-gguf`
and vLLM `qwen-vllm`, each start as long as a B70's (vLLM's about 263 s, llama.cpp's about 25 s)
times SCALE, each answer at the seed's time per token, the memory one frees taking a second to
come back (b70_engine.Driver); requests ask 64 tokens. With `--simulate` the same traces run
through b70tools.demand_sim instead, in a second: the demo's costs, or a B70's with `--b70`.

Prints, per seed and order: the swaps (switch records made during the run), p50, p95 and p99
latency per model, completion tokens per second over the run, failed and cut requests; then
what each order's swaps took, by the runtime they brought in; the policy's p95 and swaps over
the collated order's. `--json FILE` keeps each swap's time and each request's latency too, so
that runs can be pooled. `--trace FILE` replays a trace of one's
own instead (JSON lines, `--write-trace` writes a seed's in that form).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from b70tools import demand_sim
from b70tools.demand_sim import trace
from b70tools.demo_appliance import Demo, demo_appliance
from b70tools.net import free_port

CACHE = os.environ.get("B70_CACHE", str(Path.home() / ".cache" / "b70"))
MODELS = {"smollm2": "llamacpp", "smollm2-vllm": "vllm"}
B70_MODELS = {"qwen-gguf": "llamacpp", "qwen-vllm": "vllm"}
B70_TOKENS = 64
HOLD_S = 900
ORDERS = {
    "fcfs": 'order = "fcfs"\n',
    "collated": 'order = "collated"\n',
    "policy": "",  # the default
}


@dataclass
class Outcome:
    model: str
    sent: float
    seconds: float | None = None
    tokens: int = 0
    error: str | None = None
    cut: bool = False


@dataclass
class Run:
    policy: str
    outcomes: list[Outcome] = field(default_factory=list)
    swaps: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0


def one(client: Any, outcome: Outcome, max_tokens: int = 16) -> None:
    start = time.monotonic()
    try:
        stream = client.chat.completions.create(
            model=outcome.model,
            messages=[{"role": "user", "content": "Say hi in a few words."}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            timeout=HOLD_S + 120,
        )
        finished = False
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finished = True
            if chunk.usage is not None:
                outcome.tokens = chunk.usage.completion_tokens
        outcome.cut = not finished
    except Exception as e:  # every failure is counted and named
        outcome.error = f"{type(e).__name__}: {e}"[:200]
    outcome.seconds = time.monotonic() - start


def configure(text: str, policy: str) -> str:
    """The demo's config with vLLM under its own name and port, on demand, the hold raised."""
    port = free_port()
    text = text.replace("hold_s = 120", f"hold_s = {HOLD_S}")
    text = text.replace(
        '[runtimes.vllm]\nengine = "vllm"',
        f'[runtimes.vllm]\nengine = "vllm"\nserved_model_name = "smollm2-vllm"\nport = {port}',
    )
    return text + "\n[switching]\non_demand = true\n" + ORDERS[policy]


def history(demo: Demo) -> list[dict[str, Any]]:
    path = Path(demo.env["XDG_STATE_HOME"]) / "b70" / "switches.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def b70_appliance(policy: str, scale: float, costs: str = "cold") -> Any:
    """The stand-in's appliance on a fixture B70, for `policy`, with the driver that frees
    memory after a runtime has gone (beside the models, not under /tmp: the runtime units have
    a private /tmp). `costs`: "cold", every start compiles (cache_max_gib = 0: each runtime
    keeps nothing); "warm", the lasting caches kept and warmed by `install --warm` first."""
    import contextlib
    import shutil
    import tempfile

    from b70tools import b70_engine, gpu_trees
    from b70tools.b70_appliance import standin_text

    @contextlib.contextmanager
    def made() -> Any:
        where = Path(tempfile.mkdtemp(prefix=f"bench-demand-{policy}-", dir=CACHE))
        tree = gpu_trees.healthy_host(where / "sysroot", [gpu_trees.B70])
        driver = b70_engine.Driver(tree, release_s=1.0, listen=True)
        driver.start()
        names = {"llamacpp": ("qwen-gguf", 0), "vllm": ("qwen-vllm", free_port())}

        def edit(text: str) -> str:
            import tomllib

            doc = tomllib.loads(text)
            proxy, backend = doc["proxy"]["port"], doc["backend"]["port"]
            monitor = doc["monitor"]["port"]
            ports = {"llamacpp": ("qwen-gguf", backend), "vllm": names["vllm"]}
            made = standin_text(proxy, backend, monitor, where / "models", scale, names=ports) + (
                f"\n[switching]\non_demand = true\n{ORDERS[policy]}"
            ).replace("hold_s = 900", f"hold_s = {HOLD_S}")
            if costs == "cold":  # each runtime table has its start timeout: keep nothing
                made = made.replace(
                    "\nstart_timeout_s = ", "\ncache_max_gib = 0\nstart_timeout_s = "
                )
            return made

        env = {"B70_SYSROOT": str(tree), "B70_STANDIN_DRIVER": driver.address}
        try:
            with demo_appliance(
                CACHE,
                prefix=f"b70-demand-{policy}.",
                rewrite=edit,
                manager_env=env,
                install_args=("--warm",) if costs == "warm" else (),
            ) as demo:
                yield demo
        finally:
            driver.stop()
            shutil.rmtree(where, ignore_errors=True)

    return made()


def replay(
    policy: str,
    requests: list[tuple[float, str]],
    log: Any,
    b70_scale: float | None = None,
    costs: str = "",
) -> Run:
    """One replay of the trace in `policy`'s order; `costs` ("cold" or "warm", with the B70
    stand-in): whether its runtimes keep their compile caches (b70_appliance)."""
    import openai

    run = Run(f"{policy} {costs}".strip())
    edit = lambda text: configure(text, policy)  # noqa: E731
    if b70_scale is not None:
        made = b70_appliance(policy, b70_scale, costs or "cold")
    else:
        made = demo_appliance(CACHE, prefix=f"b70-demand-{policy}.", rewrite=edit)
    tokens = B70_TOKENS if b70_scale is not None else 16
    with made as demo:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{demo.proxy_port}/v1", api_key=demo.key, max_retries=0
        )
        before = len(history(demo))
        threads = []
        t0 = time.monotonic()
        for at, model in requests:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            outcome = Outcome(model, time.monotonic() - t0)
            run.outcomes.append(outcome)
            thread = threading.Thread(target=one, args=(client, outcome, tokens), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        run.wall_s = time.monotonic() - t0
        run.swaps = history(demo)[before:]
        log(f"{run.policy}: {len(requests)} requests in {run.wall_s:.0f} s, {len(run.swaps)} swaps")
    return run


def percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summary(run: Run) -> dict[str, Any]:
    per_model = {}
    for model in MODELS:
        mine = [o for o in run.outcomes if o.model == model]
        ok = [o.seconds for o in mine if o.error is None and o.seconds is not None]
        per_model[model] = {
            "requests": len(mine),
            **{f"p{q}_s": percentile(ok, q) for q in (50, 95, 99)},
            "seconds": [round(s, 3) for s in ok],  # each answered request's, to pool runs later
        }
    tokens = sum(o.tokens for o in run.outcomes)
    return {
        "policy": run.policy,
        "swaps": len(run.swaps),
        "swap_reasons": sorted({str(s.get("reason")) for s in run.swaps}),
        "swap_s": swap_times(run.swaps),
        "models": per_model,
        "tokens_per_s": tokens / run.wall_s if run.wall_s else None,
        "failed": sum(o.error is not None for o in run.outcomes),
        "cut": sum(o.cut and o.error is None for o in run.outcomes),
        "errors": sorted({o.error for o in run.outcomes if o.error})[:3],
        "wall_s": run.wall_s,
    }


def swap_times(swaps: list[dict[str, Any]]) -> dict[str, list[float]]:
    """What each swap took, by the runtime it brought in (the switch's own record): where it
    varies, so do the turns, and two replays of one order differ the more."""
    out: dict[str, list[float]] = {}
    for record in swaps:
        seconds = record.get("seconds")
        if isinstance(seconds, int | float):
            out.setdefault(str(record.get("to")), []).append(round(float(seconds), 1))
    return out


def pooled(runs: dict[str, list[Run]]) -> list[dict[str, Any]]:
    """Each replay's figures, and with several of an order its requests pooled: the figures the
    comparison takes (`replay` 0), and each replay's numbered from 1."""
    out = []
    for order, mine in runs.items():
        if len(mine) == 1:
            out.append(summary(mine[0]))
            continue
        for number, run in enumerate(mine, 1):
            out.append({**summary(run), "replay": number})
        every = Run(
            order, [o for r in mine for o in r.outcomes], [s for r in mine for s in r.swaps]
        )
        every.wall_s = sum(r.wall_s for r in mine)
        out.append({**summary(every), "replay": 0, "replays": len(mine)})
    return out


def simulated(order: str, requests: list[tuple[float, str]], b70: bool) -> dict[str, Any]:
    """The same figures from b70tools.demand_sim: the demo's swap costs, or a B70's."""
    from appliance.switch.demand.policy import Policy

    runtimes = demand_sim.B70 if b70 else demand_sim.DEMO
    arrivals = [(at, MODELS[model]) for at, model in requests]
    policy = Policy(hold_s=HOLD_S) if order == "policy" else Policy(order=order, hold_s=HOLD_S)
    result = demand_sim.simulate(arrivals, runtimes, policy, "llamacpp", hold_s=HOLD_S)
    run = Run(order, wall_s=result.end_s, swaps=[{"reason": "simulated"}] * result.swaps)
    for model, runtime in MODELS.items():
        for seconds in result.latencies[runtime]:
            run.outcomes.append(Outcome(model, 0.0, seconds, B70_TOKENS if b70 else 16))
    figures = summary(run)
    figures["failed"] = result.failed
    return figures


def show(figures: list[dict[str, Any]]) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    head = "  ".join(f"{m + ' p50/p95/p99 s':>28}" for m in MODELS)
    wide = max(
        [
            9,
            *(
                len(f["policy"]) + (6 if f.get("replays") or f.get("replay") else 0)
                for f in figures
            ),
        ]
    )
    lines = [f"{'order':<{wide}} {'swaps':>5}  {head}  {'tok/s':>6} {'failed':>6} {'cut':>4}"]
    for f in figures:
        cells = "  ".join(
            f"{'/'.join(s(f['models'][m][f'p{q}_s']) for q in (50, 95, 99)):>28}" for m in MODELS
        )
        tps = f"{f['tokens_per_s']:.2f}" if f["tokens_per_s"] is not None else "-"
        name = f["policy"] + (f" #{f['replay']}" if f.get("replay") else "")
        name += " (all)" if f.get("replays") else ""
        tail = f"{tps:>6} {f['failed']:>6} {f['cut']:>4}"
        lines.append(f"{name:<{wide}} {f['swaps']:>5}  {cells}  {tail}")
    by = {f["policy"]: f for f in figures if not f.get("replay")}
    for order, f in by.items():
        took = [f"{rt} {_span(min(t), max(t))} s" for rt, t in sorted(f.get("swap_s", {}).items())]
        if took:
            lines.append(f"{order}: its swaps took {', '.join(took)}")
    for costs in ("", " cold", " warm"):
        collated = f"collated{costs}"
        if collated in by and f"policy{costs}" in by:
            lines.append(_against(f"policy / {collated}", by[f"policy{costs}"], by[collated]))
        if collated in by and by[collated].get("replays"):
            first, second = (
                f for f in figures if f["policy"] == collated and f.get("replay") in (1, 2)
            )
            lines.append(_against(f"{collated} #2 / #1 (the same order twice)", second, first))
    for order in ORDERS:  # the same order at a B70's warm costs against its cold ones
        if f"{order} warm" in by and f"{order} cold" in by:
            pair = (by[f"{order} warm"], by[f"{order} cold"])
            lines.append(_against(f"{order}: warm / cold", *pair))
    return "\n".join(lines)


def _span(low: float, high: float) -> str:
    return f"{low:.0f}" if f"{low:.0f}" == f"{high:.0f}" else f"{low:.0f}-{high:.0f}"


def _against(name: str, ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Each model's p95, and the swaps, of one set of figures over another's."""
    ratios = []
    for m in MODELS:
        a, b = ours["models"][m]["p95_s"], theirs["models"][m]["p95_s"]
        ratios.append(f"{m} p95 {a / b:.2f}" if a and b else f"{m} p95 -")
    return f"{name}: {', '.join(ratios)}; swaps {ours['swaps']} against {theirs['swaps']}"


def read_trace(path: Path) -> list[tuple[float, str]]:
    """A trace of one's own: JSON lines of {"at": seconds from the start, "model": NAME}, NAME a
    model the demo serves (smollm2, smollm2-vllm) or the runtime that serves it (llamacpp, vllm).
    A line that is not such an entry stops the bench with its number."""
    by_runtime = {runtime: model for model, runtime in MODELS.items()}
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            at, model = float(entry["at"]), str(entry["model"])
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"{path}:{number}: not a line of a trace: {line[:80]!r}") from None
        model = by_runtime.get(model, model)
        if model not in MODELS or not 0 <= at < 86400:
            raise SystemExit(f"{path}:{number}: a model of {sorted(MODELS)} at 0 s or later")
        out.append((at, model))
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", default="1", help="a seed, or several: 1,2")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals")
    parser.add_argument("--gap-llamacpp", type=float, default=6.0, help="mean seconds between")
    parser.add_argument("--gap-vllm", type=float, default=10.0, help="mean seconds between")
    parser.add_argument("--trace", type=Path, help="replay this trace (JSON lines), not a seed's")
    parser.add_argument("--write-trace", type=Path, help="write the trace here (JSON lines)")
    parser.add_argument("--orders", default="fcfs,collated,policy")
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="replay each order this many times per trace, taking turns; the table adds each "
        "order's requests pooled, and the collated order against itself",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--b70", type=float, metavar="SCALE",
        help="on the B70 stand-in, its times scaled by SCALE (0.1: a vLLM start of 26 s)",
    )  # fmt: skip
    parser.add_argument(
        "--simulate", action="store_true", help="b70tools.demand_sim instead of the appliance"
    )
    parser.add_argument(
        "--caches",
        default="cold,warm",
        help="with --b70: each order with its runtimes' compile caches emptied at every start "
        "(cold), kept and warmed at install (warm), or both",
    )
    args = parser.parse_args()
    costs = [c for c in args.caches.split(",") if c]
    if any(c not in ("cold", "warm") for c in costs) or not costs:
        raise SystemExit(f"--caches: cold, warm or both, not {args.caches!r}")
    if args.b70 is None or args.simulate:
        costs = [""]  # the demo's vLLM compiles nothing in the benchmarks (--enforce-eager)
    if args.b70 is not None:
        if not 0 < args.b70 <= 1:
            raise SystemExit("--b70: a scale above 0 and at most 1")
        MODELS.clear()
        MODELS.update(B70_MODELS)
    try:
        seeds = [int(x) for x in str(args.seed).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--seed: whole numbers separated by commas, not {args.seed!r}") from None
    orders = [o for o in args.orders.split(",") if o]
    if not 1 <= args.repeat <= 20:
        raise SystemExit(f"--repeat: 1 to 20 replays of each order, not {args.repeat}")
    for order in orders:
        if order not in ORDERS:
            raise SystemExit(f"--orders: {order!r} is not one of {', '.join(ORDERS)}")
    first, second = list(MODELS)
    gaps = {first: args.gap_llamacpp, second: args.gap_vllm}
    results = []
    for index, seed in enumerate([0] if args.trace else seeds):
        requests = read_trace(args.trace) if args.trace else trace(seed, args.duration, gaps)
        if args.write_trace:
            lines = [json.dumps({"at": round(at, 3), "model": model}) for at, model in requests]
            args.write_trace.write_text("".join(line + "\n" for line in lines))
        counts = {m: sum(1 for _, x in requests if x == m) for m in MODELS}
        name = str(args.trace) if args.trace else f"seed {seed}"
        span = requests[-1][0] if requests else 0.0
        print(f"{name}: {len(requests)} requests over {span:.0f} s, {counts}", flush=True)
        figures = []
        runs: dict[str, list[Run]] = {order: [] for order in orders}
        turn = orders if index % 2 == 0 else list(reversed(orders))
        for again in range(1 if args.simulate else args.repeat):
            for order in turn if again % 2 == 0 else list(reversed(turn)):
                if args.simulate:
                    figures.append(simulated(order, requests, args.b70 is not None))
                    continue
                log = lambda m: print(m, flush=True)  # noqa: E731
                for cost in costs:
                    label = f"{order} {cost}".strip()
                    runs.setdefault(label, []).append(replay(order, requests, log, args.b70, cost))
        if not args.simulate:
            figures = pooled({k: v for k, v in runs.items() if v})
        labels = [f"{o} {c}".strip() for o in orders for c in costs]
        figures.sort(key=lambda f: (labels.index(f["policy"]), f.get("replay", 0)))
        print(show(figures), flush=True)
        results.append({"trace": name, "figures": figures})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
