"""b70ctl: render, install and switch the appliance's systemd units.

One click group, one short function per command, one error handler (`main`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from appliance import config as config_mod
from appliance import output
from appliance.config import Config
from appliance.errors import ApplianceError, from_exception
from appliance.layout import Scope


@dataclasses.dataclass
class Context:
    config_path: Path | None
    scope: Scope
    debug: bool
    json: bool = False

    def config(self) -> Config:
        return config_mod.load(self.config_path or config_mod.default_config_path(self.scope))


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


def with_json(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adds --json and records it on the context, so errors are printed as JSON too."""

    @json_option
    @click.pass_obj
    def wrapper(ctx: Context, /, as_json: bool, **kwargs: Any) -> Any:
        ctx.json = as_json
        return fn(ctx, **kwargs)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class ApplianceGroup(click.Group):
    """The one error path, for every command: message and hint, or the JSON envelope.

    Any exception a command lets escape (the appliance's own, OSError, decoding, D-Bus, a
    subprocess timeout, Ctrl-C) ends here; click's own exceptions (usage errors, exit) go on to
    `main`. A traceback is printed only with --debug.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (Exception, KeyboardInterrupt) as exc:
            obj = ctx.obj
            if obj is not None and obj.debug:
                raise
            error = from_exception(exc)
            if obj is not None and obj.json:
                output.emit_json_error(error)
            else:
                output.emit_error(error)
            ctx.exit(error.exit_code)


@click.group(
    cls=ApplianceGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    envvar="B70_CONFIG",
    help="The appliance config (default /etc/b70/appliance.toml; with --user "
    "~/.config/b70/appliance.toml). Env: B70_CONFIG.",
)
@click.option(
    "--user",
    "user_scope",
    is_flag=True,
    envvar="B70_USER",
    help="Use the user's systemd manager instead of the system one. Env: B70_USER=1.",
)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.version_option(package_name="b70-appliance")
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None, user_scope: bool, debug: bool) -> None:
    """Run vLLM and llama.cpp on an Intel Arc Pro B70 under systemd, behind one proxy on :8000.

    \b
    Example:
      b70ctl install && b70ctl switch llamacpp && b70ctl status
    """
    ctx.obj = Context(config_path, Scope.USER if user_scope else Scope.SYSTEM, debug)


@cli.command()
@click.option("--out", type=click.Path(path_type=Path), help="Write the files into this directory.")
@click.option(
    "--diff", is_flag=True, help="Show how the rendered files differ from the installed ones."
)
@with_json
def render(ctx: Context, out: Path | None, diff: bool) -> None:
    """Render the units and the proxy config from the config file.

    \b
    Example:
      b70ctl --config examples/b70.toml render --out /tmp/units
      b70ctl render --diff
    """
    from appliance.files import write_atomic
    from appliance.install import render_diff
    from appliance.layout import layout
    from appliance.render import render_all

    config = ctx.config()
    if diff:
        text = render_diff(config, ctx.scope)
        output.show(ctx.json, {"changed": bool(text), "diff": text}, lambda: text.rstrip("\n"))
        sys.exit(1 if text else 0)
    files = render_all(config, layout(ctx.scope))
    if out is None:
        output.show(ctx.json, {"files": files}, lambda: output.render_listing(files))
        return
    for name, text in files.items():
        write_atomic(out / name, text)
    written = [str(out / name) for name in files]
    output.show(ctx.json, {"written": written}, lambda: output.render_files(written))


@cli.command()
@click.option(
    "--now/--no-now",
    default=True,
    show_default=True,
    help="Start the proxy and, if none runs, the default runtime.",
)
@with_json
def install(ctx: Context, now: bool) -> None:
    """Install the rendered units, then daemon-reload and enable them.

    Verifies the units with systemd-analyze first and writes nothing if that fails. Creates the
    proxy's master key file (mode 0600) if it does not exist yet.

    \b
    Example:
      sudo b70ctl install
      b70ctl --user --config examples/demo.toml install
    """
    from appliance import install as install_mod

    result = install_mod.install(ctx.config(), ctx.scope, now, output.progress)
    doc = dataclasses.asdict(result)
    output.show(ctx.json, doc, lambda: output.render_install(doc))


@cli.command()
@click.option(
    "--purge",
    is_flag=True,
    help="Also delete the proxy key, the switch records and each unit's cache directory.",
)
@with_json
def uninstall(ctx: Context, purge: bool) -> None:
    """Stop and disable every b70 unit and remove the installed files.

    \b
    Example:
      sudo b70ctl uninstall --purge
    """
    from appliance import install as install_mod

    removed = install_mod.uninstall(ctx.config(), ctx.scope, purge)
    output.show(ctx.json, {"removed": removed}, lambda: output.render_removed(removed))


@cli.command()
@click.argument("name")
@click.option("--restart", is_flag=True, help="Restart NAME even if it is already serving.")
@click.option("--gate", is_flag=True, help="Run the validity gates before the switch counts.")
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    help="Seconds to wait for the old runtime's requests to finish (default: [proxy] drain_s).",
)
@with_json
def switch(ctx: Context, name: str, restart: bool, gate: bool, drain_timeout: float | None) -> None:
    """Make runtime NAME the one serving, or roll back to the previous one and fail.

    New requests wait at the proxy while the old runtime finishes what it has in flight, stops,
    and NAME starts; clients see a slower answer, not an error.

    \b
    Example:
      sudo b70ctl switch llamacpp
    """
    from appliance import switching, units

    progress = output.progress if sys.stderr.isatty() or not ctx.json else units.no_progress
    result = switching.switch(
        ctx.config(), ctx.scope, name, restart, progress, gate, drain_s=drain_timeout
    )
    data = dataclasses.asdict(result)
    data.pop("journal")
    output.show(ctx.json, data, lambda: output.render_switch(data))


@cli.command()
@with_json
def status(ctx: Context) -> None:
    """Show which runtime serves, every b70 unit, health, and the last switch.

    \b
    Example:
      b70ctl status --json | jq .result.active_runtime
    """
    from appliance import status as status_mod

    result = status_mod.status(ctx.config(), ctx.scope)
    output.show(ctx.json, result, lambda: output.render_status(result))


@cli.command()
@click.option("--once", is_flag=True, help="Take one sample, act on it, and exit.")
@with_json
def monitor(ctx: Context, once: bool) -> None:
    """Watch the serving runtime: restart it when it hangs, fail over when it does not come back.

    Runs as b70-monitor.service. Samples backend and proxy health, a probe completion, GPU
    memory and the runtime's metrics every [monitor] interval_s, and serves Prometheus metrics
    on [monitor] host:port.

    \b
    Example:
      b70ctl monitor --once && curl -s http://127.0.0.1:9101/metrics | grep ^b70_
    """
    from appliance import monitor as monitor_mod

    if ctx.json and not once:
        raise ApplianceError(
            "monitor runs until it is stopped; --json prints one sample",
            hint="add --once",
            code="usage_error",
            exit_code=2,
        )
    sample = monitor_mod.run(ctx.config(), ctx.scope, unitgate_log, once=once)
    output.show(ctx.json, sample)


@cli.command()
@click.argument("name")
@click.option("-n", "--lines", default=100, show_default=True, help="How many lines.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@with_json
def logs(ctx: Context, name: str, lines: int, follow: bool) -> None:
    """Show the journal of runtime NAME, of the proxy (NAME: proxy) or of the monitor.

    \b
    Example:
      b70ctl logs vllm -n 50
    """
    from appliance import systemd
    from appliance.layout import MONITOR_UNIT, PROXY_UNIT

    if lines < 1:
        raise ApplianceError(
            f"--lines {lines}: must be at least 1", code="usage_error", exit_code=2
        )
    config = ctx.config()
    own = {"proxy": PROXY_UNIT, "litellm": PROXY_UNIT, "monitor": MONITOR_UNIT}
    unit = own[name] if name in own else config.runtime(name).unit
    if ctx.json:
        if follow:
            raise ApplianceError(
                "--follow prints lines as they come and does not go with --json",
                hint="drop one of them",
                code="usage_error",
                exit_code=2,
            )
        text = systemd.journal_excerpt(ctx.scope, unit, lines)
        output.show(True, {"unit": unit, "lines": text.splitlines()})
        return
    argv = systemd.journal_command(ctx.scope, unit, lines, follow)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        raise ApplianceError(
            f"cannot run journalctl: {e.strerror}", hint="install systemd"
        ) from None


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
@click.option("--cpu-offload-gib", type=float, default=0.0, show_default=True)
@click.option(
    "--reserve-gib",
    type=float,
    default=0.0,
    show_default=True,
    help="Memory kept for activations and workspace.",
)
@click.option(
    "--batch",
    "batches",
    type=int,
    multiple=True,
    help="Batch sizes for the decode step (default 1 and 64).",
)
@with_json
def plan(ctx: Context, config_json: Path, **options: Any) -> None:
    """Memory and decode speed of a model on a card, from its Hugging Face config.json.

    GDN state per request, KV cache per token, weights, requests that fit at a memory
    utilization, and the memory-bound decode step at the card's bandwidth.

    \b
    Example:
      b70ctl plan config.json --quantization gptq-int4 --kv-dtype fp8 --state-dtype fp16 \\
        --utilization 0.82 --tokens 1024 --cpu-offload-gib 4
    """
    import json as json_mod

    from appliance import capacity

    try:
        cfg = json_mod.loads(config_json.read_text())
    except (OSError, ValueError) as e:
        raise ApplianceError(
            f"{config_json}: not a readable JSON file: {e}", code="plan_input_invalid"
        ) from None
    if not isinstance(cfg, dict):
        raise ApplianceError(f"{config_json}: not a JSON object", code="plan_input_invalid")
    capacity.check_plan_inputs(options["utilization"], options["tokens"])
    card_bytes, bandwidth = capacity.CARDS[options["card"]]
    if options["card_gib"]:
        card_bytes = int(options["card_gib"] * capacity.GIB)
    if options["bandwidth_gbs"]:
        bandwidth = options["bandwidth_gbs"] * 1e9
    result = capacity.plan(
        cfg,
        dtype=options["dtype"],
        quant=options["quant"],
        kv_dtype=options["kv_dtype"],
        state_dtype=options["state_dtype"],
        card_bytes=card_bytes,
        bandwidth=bandwidth,
        utilization=options["utilization"],
        tokens=options["tokens"],
        cpu_offload_bytes=int(options["cpu_offload_gib"] * capacity.GIB),
        reserve_bytes=int(options["reserve_gib"] * capacity.GIB),
        batches=tuple(options["batches"]) or (1, 64),
    )
    output.show(ctx.json, dataclasses.asdict(result), lambda: output.render_plan(result))


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
    from appliance import gate, systemd, units
    from appliance.layout import layout

    config = ctx.config()
    with systemd.connect(ctx.scope) as sd:
        serving = units.require_serving(config, sd)
    result = gate.through_proxy(config, layout(ctx.scope), serving, record=record, k=k)
    doc = {"runtime": result.runtime, "ok": result.ok, "checks": [vars(c) for c in result.checks]}
    if not ctx.json:
        output.show(False, doc, lambda: output.render_gate(doc))
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

    from appliance import bench as bench_mod

    w, runtime_url, metrics_url, runtime = _bench_target(ctx, o)
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


def _bench_target(ctx: Context, o: dict[str, Any]) -> tuple[Any, str, str, dict[str, Any]]:
    from appliance import bench as bench_mod
    from appliance import runtimes

    runtime: dict[str, Any] = {
        "name": None,
        "engine": o["engine"],
        "unit": None,
        "invocation_id": None,
    }
    config = None
    if not (o["url"] and o["model"] and o["runtime_url"] and o["engine"]):
        config = ctx.config()
    url = o["url"] or runtimes.proxy_url(config)  # type: ignore[arg-type]
    runtime_url = o["runtime_url"] or runtimes.backend_url(config)  # type: ignore[arg-type]
    key = o["api_key"]
    if config is not None:
        from appliance import state, systemd, units
        from appliance.layout import layout

        key = key or state.read_key(layout(ctx.scope))
        with systemd.connect(ctx.scope) as sd:
            name = units.require_serving(config, sd)
            rt = config.runtimes[name]
            runtime = {
                "name": name,
                "engine": rt.engine.value,
                "unit": rt.unit,
                "invocation_id": sd.state(rt.unit).invocation_id,
            }
        runtime["engine"] = o["engine"] or runtime["engine"]
    w = bench_mod.Workload(
        url=url,
        model=o["model"] or (config.proxy.model if config else ""),
        api_key=key or "none",
        requests=o["n_requests"],
        concurrency=o["concurrency"],
        input_tokens=o["input_tokens"],
        output_tokens=o["output_tokens"],
        seed=o["seed"],
    )
    return w, runtime_url, runtime_url + "/metrics", runtime


root_option = click.option(
    "--root",
    type=click.Path(path_type=Path),
    hidden=True,
    help="Read sysfs, /proc and /dev under this directory (fixture trees). Env: B70_SYSROOT.",
)


def gpu_root(root: Path | None) -> Path:
    from appliance.gpu import sysroot

    return root or sysroot()


@cli.group(invoke_without_command=True)
@root_option
@with_json
def gpu(ctx: Context, root: Path | None) -> None:
    """List Intel GPUs, their memory, and who holds it (per process and unit).

    \b
    Example:
      b70ctl gpu
      b70ctl gpu --json | jq '.result.devices[0].free_bytes'
    """
    click_ctx = click.get_current_context()
    if click_ctx.invoked_subcommand is not None:
        return
    from appliance import gpu as gpu_mod

    snap = gpu_mod.snapshot(gpu_root(root))
    output.show(ctx.json, output.gpu_document(snap), lambda: output.render_gpu(snap))


@gpu.command("wait-free")
@click.option(
    "--need-bytes", type=int, default=0, show_default=True, help="Memory the start needs."
)
@click.option("--need-gib", type=float, help="The same in GiB.")
@click.option("--device", default="auto", show_default=True, help="PCI address, or auto.")
@click.option("--unit", help="The unit about to start (its own memory does not count).")
@click.option(
    "--timeout", "timeout_s", type=click.FloatRange(min=0), default=120, show_default=True
)
@root_option
@with_json
def gpu_wait_free(
    ctx: Context,
    need_bytes: int,
    need_gib: float | None,
    device: str,
    unit: str | None,
    timeout_s: float,
    root: Path | None,
) -> None:
    """Wait until other runtimes have released GPU memory and enough is free.

    Every runtime unit runs this as ExecStartPre. With no Intel GPU it passes at once.

    \b
    Example:
      b70ctl gpu wait-free --need-gib 24 --timeout 120
    """
    from appliance.gpu import memgate

    if need_bytes < 0 or (need_gib is not None and not 0 <= need_gib <= 1024**2):
        raise ApplianceError(
            "--need-bytes and --need-gib must be between 0 and 1 PiB",
            code="usage_error",
            exit_code=2,
        )
    need = int(need_gib * memgate.GIB) if need_gib is not None else need_bytes
    memgate.wait_start(gpu_root(root), device, need, unit, timeout_s, unitgate_log)
    output.show(ctx.json, {"device": device, "need_bytes": need, "free": True})


def unitgate_log(message: str) -> None:
    output.log(message)


@cli.group(hidden=True)
def unit() -> None:
    """Gates that the rendered units run around their main process (not for people)."""


@unit.command("pre")
@click.option("--port", type=int, required=True)
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=10.0)
@with_json
def unit_pre(ctx: Context, port: int, wait_s: float) -> None:
    """ExecStartPre: the backend port must be free."""
    from appliance import unitgate

    unitgate.pre(port, wait_s)
    output.show(ctx.json, {"port": port, "free": True})


@unit.command("ready")
@click.option("--url", required=True)
@click.option("--engine", required=True)
@click.option("--pid", type=int, required=True)
@click.option("--container")
@click.option("--container-cli")
@with_json
def unit_ready(
    ctx: Context, url: str, engine: str, pid: int, container: str | None, container_cli: str | None
) -> None:
    """ExecStartPost: wait until URL is healthy and served by PID's own process tree."""
    from urllib.parse import urlsplit

    from appliance import unitgate

    try:
        port = urlsplit(url).port
    except ValueError:
        port = None
    if port is None:
        raise ApplianceError(f"--url {url} names no valid port", code="usage_error", exit_code=2)
    unitgate.ready(unitgate.ReadyTarget(url, engine, port, pid, container, container_cli))
    output.show(ctx.json, {"url": url, "ready": True})


def main(argv: list[str] | None = None) -> None:
    """The console script: click's usage errors, too, become the JSON envelope with --json.
    `argv`: the arguments, when not those of the process (the tests call it in-process)."""
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    try:
        code = cli.main(args=args, standalone_mode=False)
    except click.exceptions.Abort:  # Ctrl-C while click itself was prompting or parsing
        code = _fail(ApplianceError("interrupted", code="interrupted", exit_code=130), as_json)
    except click.ClickException as e:
        if as_json:
            error = ApplianceError(
                e.format_message(),
                hint="see b70ctl COMMAND --help",
                code="usage_error",
                exit_code=e.exit_code,
            )
            code = _fail(error, as_json)
        else:
            e.show()
            code = e.exit_code
    sys.exit(code if isinstance(code, int) else 0)


def _fail(error: ApplianceError, as_json: bool) -> int:
    if as_json:
        output.emit_json_error(error)
    else:
        output.emit_error(error)
    return error.exit_code
