"""The commands that measure: plan (memory and speed on paper), gate (validity), bench."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from appliance.cli import output
from appliance.cli.base import Context, cli, with_json
from appliance.errors import ApplianceError


@cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("target")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--tokens",
    type=int,
    help="The length of the requests to count at once (default: the max model length).",
)
@click.option(
    "--kv-cache-gib",
    type=float,
    help="The cache of each card as vLLM measured it (its log's 'Available KV cache memory'), "
    "instead of the budget worked out from the card, the weights and the profile.",
)
@click.option(
    "--weights-gib",
    type=float,
    help="The weights on each card as vLLM logged them ('Model loading took'), instead of the "
    "estimate from config.json.",
)
@click.option(
    "--vllm-version",
    help="The vLLM release: before 0.20 it counted its KV cache size in tokens otherwise.",
)
@click.option("--card", type=click.Choice(["b70"]), default="b70", show_default=True)
@click.option("--card-gib", type=float, help="Card memory as vLLM sees it, instead of the card's.")
@click.option(
    "--bandwidth-gbs", type=float, help="Memory bandwidth in GB/s, instead of the card's."
)
@click.option(
    "--compare",
    "compare_url",
    metavar="URL",
    help="A running vLLM (such as http://127.0.0.1:8001): put the plan beside the cache it "
    "reports, and say how far apart they are.",
)
@click.option(
    "--batch",
    "batches",
    type=int,
    multiple=True,
    help="Batch sizes for the decode step (default 1 and 64).",
)
@with_json
def plan(ctx: Context, target: str, vllm_args: tuple[str, ...], compare_url: str | None,
         **options: Any) -> None:  # fmt: skip
    """What vLLM will print at start-up, before a minutes-long start: TARGET is a model's
    Hugging Face config.json followed by `vllm serve`'s flags, or a vLLM runtime of the
    appliance's config (planned from its own args).

    Prints the lines of vLLM's start-up log (model loading, available KV cache memory,
    attention block size, mamba padding, GPU KV cache size, maximum concurrency), then how
    many requests of --tokens run at once, and whether one request of the max model length
    fits at all.

    \b
    Example:
      b70ctl plan config.json --quantization gptq --dtype float16 --kv-cache-dtype fp8 \\
        --max-model-len 16384 --gpu-memory-utilization 0.82 --max-num-seqs 64 \\
        --max-num-batched-tokens 8192 --no-enable-prefix-caching --tokens 1024
      b70ctl plan config.json -tp 2 --max-model-len 131072 \\
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 5}'
      b70ctl plan vllm --tokens 1024
    """
    from appliance.measure import capacity, measured, recipe, serveflags

    if recipe.names_a_file(target):
        cfg = capacity.read_config(Path(target))
        serve = serveflags.parse(vllm_args)
        env: dict[str, str] = {}
        where = target
    else:
        if vllm_args:
            raise ApplianceError(
                f"plan {target} takes the runtime's own args; "
                f"extra flags {' '.join(vllm_args)!r} are not used",
                hint=f"change runtimes.{target}.args, or plan its config.json with these flags",
                code="plan_input_invalid",
            )
        rt = ctx.config().runtime(target)
        cfg, where = recipe.model_config(rt)
        serve, env = recipe.serve_of(rt), dict(rt.env)
    result = capacity.plan_options(cfg, serve, options, env)
    doc = output.plan_document(result, serve, where)
    if compare_url is None:
        output.show(ctx.json, doc, lambda: output.render_plan(result, serve))
        return
    compared = measured.against(
        compare_url,
        result,
        lambda n: capacity.plan_options(cfg, serve, {**options, "tokens": n}, env),
    )
    doc["compared"] = {**dataclasses.asdict(compared), "rows": [
        {**dataclasses.asdict(r), "apart": r.apart} for r in compared.rows
    ]}  # fmt: skip
    output.show(ctx.json, doc, lambda: output.render_plan(result, serve, compared))


@cli.command("gate")
@click.option("--record", is_flag=True, help="Record the canaries' answers anew for this runtime.")
@click.option("--json-requests", "k", type=int, default=4, show_default=True)
@with_json
def gate_cmd(ctx: Context, record: bool, k: int) -> None:
    """Validity gates for the serving runtime: JSON mode and greedy canaries.

    JSON mode sends K requests with a JSON schema (response_format); every reply must parse and
    match it. Canaries are fixed prompts whose greedy answers are recorded per runtime the
    first time and must come back the same. Exits 1 naming what failed.

    \b
    Example:
      b70ctl gate && b70ctl switch vllm --gate
    """
    from appliance.layout import layout
    from appliance.measure import gate
    from appliance.units import serving as units
    from appliance.units import systemd

    ctx.require_root("gate")  # it records the canaries' first answers in the state directory
    config = ctx.config()
    with systemd.connect(ctx.scope) as sd:
        serving = units.require_serving(config, sd)
    result = gate.through_proxy(config, layout(ctx.scope), serving, record=record, k=k)
    checks = [vars(c) for c in result.checks]
    doc = {"runtime": result.runtime, "ok": result.ok, "checks": checks}
    if not ctx.json:
        output.show(False, doc, lambda: output.render_checks(checks))
    gate.require(result)
    output.show(ctx.json, doc)


@cli.command()
@click.option("--url", help="Where to send requests (default: the proxy).")
@click.option("--model", help="Model name (default: the proxy's public name).")
@click.option("--api-key", envvar="B70_API_KEY", help="API key (default: the proxy's master key).")
@click.option(
    "--runtime-url",
    help="The runtime itself, for its tokenizer and metrics (default: the backend).",
)
@click.option(
    "--engine",
    type=click.Choice(["vllm", "llamacpp"]),
    help="The runtime's engine (default: the active one).",
)
@click.option("--requests", "n_requests", type=int, default=128, show_default=True)
@click.option(
    "--concurrency", type=int, default=64, show_default=True, help="Requests in flight at most."
)
@click.option("--input-tokens", type=int, default=512, show_default=True)
@click.option("--output-tokens", type=int, default=512, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="The JSON result file (default: bench-TIME.json).",
)
@with_json
def bench(ctx: Context, **o: Any) -> None:
    """Measure the serving runtime like the B70 recipes: concurrency proven by its own metrics.

    Random-token prompts, fixed-length answers with ignore_eos, greedy, streaming. Reports TTFT,
    TPOT and ITL (median, p99), tokens/s, and how many requests ran at once; the generation
    figure (concurrency / median TPOT) only if that many really did.

    \b
    Example:
      b70ctl bench --requests 128 --concurrency 64 --out b70-vllm.json
    """
    import asyncio
    import json
    import time

    from appliance.measure import bench as bench_mod

    w, runtime_url, metrics_url, runtime = bench_mod.target(ctx.config, ctx.scope, o)
    if w.requests < 1 or not 1 <= w.concurrency <= w.requests:
        raise ApplianceError(
            "--concurrency must be between 1 and --requests", code="bench_input_invalid"
        )
    output.progress("preparing", f"{w.requests} random-token prompts of {w.input_tokens} tokens")
    prompts = bench_mod.make_prompts(runtime_url, runtime["engine"], w.model, w)
    bar = output.ProgressBar() if sys.stderr.isatty() else None
    results, samples, wall = asyncio.run(
        bench_mod.run(w, prompts, metrics_url, bar.update if bar else None)
    )
    if bar:
        bar.close()
    doc = bench_mod.result_document(w, results, samples, wall, runtime)
    out = o["out"] or Path(time.strftime("bench-%Y%m%d-%H%M%S.json"))
    from appliance.files import write_atomic

    write_atomic(out, json.dumps(doc, indent=2) + "\n")
    output.show(
        ctx.json,
        {"result_file": str(out), **doc["summary"]},
        lambda: output.render_bench(doc["summary"], w.concurrency) + f"\nresult file: {out}",
    )
