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


@cli.command()
@click.argument("config_json", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--dtype",
    default="bf16",
    show_default=True,
    help="Weights dtype (and of what is not quantized).",
)
@click.option(
    "--quantization",
    "quant",
    default="none",
    show_default=True,
    help="none, fp8, gptq-int4, gptq-int8, q8_0, q4_k_m.",
)
@click.option(
    "--kv-dtype", default="bf16", show_default=True, help="KV cache dtype (fp8, fp16, bf16, fp32)."
)
@click.option(
    "--state-dtype", default="fp32", show_default=True, help="GDN state dtype (fp32, fp16)."
)
@click.option("--card", type=click.Choice(["b70"]), default="b70", show_default=True)
@click.option("--card-gib", type=float, help="Card memory, instead of the card's.")
@click.option(
    "--bandwidth-gbs", type=float, help="Memory bandwidth in GB/s, instead of the card's."
)
@click.option(
    "--utilization", type=float, default=0.9, show_default=True, help="GPU memory utilization."
)
@click.option(
    "--tokens", type=int, default=4096, show_default=True, help="Tokens of context per request."
)
@click.option(
    "--cards",
    type=int,
    default=1,
    show_default=True,
    help="Cards the model is split over (vLLM's tensor parallelism); figures are per card.",
)
@click.option(
    "--block-align",
    type=int,
    default=None,
    help="What vLLM rounds the attention block size of a hybrid model to. Default: 64 for a "
    "model with GDN layers, as vLLM on XPU rounds it; 16, vLLM's own, otherwise.",
)
@click.option(
    "--cpu-offload-gib", type=float, default=0.0, show_default=True, help="Per card, as vLLM's."
)
@click.option(
    "--cpu-offload-params",
    "offload_params",
    type=click.Choice(["all", "embed_tokens"]),
    default="all",
    show_default=True,
    help="What may be offloaded. vLLM offloads only the decoder layers' parameters, so "
    "embed_tokens offloads nothing.",
)
@click.option(
    "--reserve-gib",
    type=float,
    default=0.0,
    show_default=True,
    help="Memory kept for activations and workspace.",
)
@click.option(
    "--max-num-batched-tokens",
    "batched_tokens",
    type=int,
    default=2048,
    show_default=True,
    help="As vLLM's (its default for a card under 70 GiB): the tokens of its start-up profile, "
    "whose peak vLLM keeps back from the cache; 0: none.",
)
@click.option(
    "--max-num-seqs",
    "max_seqs",
    type=int,
    default=256,
    show_default=True,
    help="As vLLM's: the rows of the sampler in its start-up profile.",
)
@click.option(
    "--kv-cache-gib",
    type=float,
    help="The cache of each card as vLLM measured it (its log's 'Available KV cache memory'), "
    "instead of the budget worked out from the utilization, weights and reserve.",
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
def plan(ctx: Context, config_json: Path, compare_url: str | None, **options: Any) -> None:
    """Memory and decode speed of a model on a card, from its Hugging Face config.json.

    GDN state per request, KV cache per token, weights and cache per card, the requests that
    fit at a memory utilization as vLLM lays out its cache (hybrid models' pages unified to one
    size), and the memory-bound decode step at the cards' bandwidth.

    \b
    Example:
      b70ctl plan config.json --quantization gptq-int4 --kv-dtype fp8 --state-dtype fp16 \\
        --utilization 0.82 --tokens 1024 --cpu-offload-gib 4 --cpu-offload-params embed_tokens
      b70ctl plan config.json --quantization gptq-int4 --kv-dtype fp8 --cards 2
      b70ctl plan config.json --utilization 0.9 --compare http://127.0.0.1:8001
    """
    from appliance.measure import capacity, measured

    result = capacity.plan_file(config_json, options)
    doc = dataclasses.asdict(result)
    if compare_url is None:
        output.show(ctx.json, doc, lambda: output.render_plan(result))
        return
    compared = measured.against(
        compare_url, result, lambda n: capacity.plan_file(config_json, {**options, "tokens": n})
    )
    doc["compared"] = {**dataclasses.asdict(compared), "rows": [
        {**dataclasses.asdict(r), "apart": r.apart} for r in compared.rows
    ]}  # fmt: skip
    output.show(ctx.json, doc, lambda: output.render_plan(result, compared))


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
