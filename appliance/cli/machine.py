"""The commands about the machine: gpu (memory and who holds it), doctor, setup (a config from
the cards found), and the guards the rendered units run around their main process (unit pre,
unit ready)."""

from __future__ import annotations

from pathlib import Path

import click

from appliance import GIB
from appliance.cli import output
from appliance.cli.base import Context, cli, guard_log, with_json
from appliance.config import Engine
from appliance.errors import ApplianceError

root_option = click.option(
    "--root",
    type=click.Path(path_type=Path),
    hidden=True,
    help="Read sysfs, /proc and /dev under this directory (fixture trees). Env: B70_SYSROOT.",
)


def gpu_root(root: Path | None) -> Path:
    from appliance.host.gpu import sysroot

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
    from appliance.host import gpu as gpu_mod

    snap = gpu_mod.snapshot(gpu_root(root))
    output.show(ctx.json, output.gpu_document(snap), lambda: output.render_gpu(snap))


@cli.command()
@root_option
@with_json
def doctor(ctx: Context, root: Path | None) -> None:
    """Check this host for the appliance: cards and the xe driver, the kernel, the render group,
    /dev/dri/by-path, CAP_PERFMON, the container engine and images, the models (whole, by
    their headers), llama-server's libraries, host memory for --cpu-offload-gb, and each
    runtime's compile cache (its size, and whether it is warm for the installed recipe).

    Prints one line per check, with the fix for each that fails; exits 1 if any fails.

    \b
    Example:
      sudo b70ctl --config /etc/b70/appliance.toml doctor
    """
    from appliance.deploy import warm
    from appliance.host import doctor as doctor_mod
    from appliance.measure import recipe

    config = ctx.config()
    checks = doctor_mod.doctor(config, gpu_root(root)) + recipe.doctor_checks(
        config, gpu_root(root)
    )
    checks += warm.cache_checks(config, ctx.scope, gpu_root(root))
    doc = {"checks": [vars(c) for c in checks]}
    if not ctx.json:
        output.show(False, doc, lambda: output.render_checks(doc["checks"]))
    doctor_mod.require(checks)
    output.show(ctx.json, doc)


@cli.command()
@click.option("--dry-run", is_flag=True, help="Print the config; write nothing.")
@click.option("--force", is_flag=True, help="Replace a config there, keeping it beside as .bak.")
@root_option
@with_json
def setup(ctx: Context, dry_run: bool, force: bool, root: Path | None) -> None:
    """Write the config from the cards found here: examples/b70.toml's recipes where they fit,
    tensor parallelism for vLLM (on a kernel 7.1 or later) and a llama.cpp per card on two or
    more B70s, with a comment per choice. Then `b70ctl install`.

    \b
    Example:
      sudo b70ctl setup --dry-run
      sudo b70ctl setup && sudo b70ctl install
    """
    from appliance import config as config_mod
    from appliance.deploy import setup as setup_mod
    from appliance.deploy.install import keep_beside
    from appliance.files import write_atomic
    from appliance.host import gpu as gpu_mod

    target = ctx.config_path or config_mod.default_config_path(ctx.scope)
    snap = gpu_mod.snapshot(gpu_root(root))
    text = setup_mod.write(
        snap,
        config_mod.default_b70ctl(),
        setup_mod.engine_found(),
        setup_mod.kernel_found(gpu_root(root)),
    )
    left_out = list(setup_mod.skipped(snap))
    doc: dict[str, object] = {"path": str(target), "text": text, "written": False, "kept": None,
                              "left_out": left_out}  # fmt: skip
    if not dry_run:
        ctx.require_root("setup")
        old = target.read_text(errors="replace") if target.exists() else None
        if old is not None and old != text and not force:
            raise ApplianceError(
                f"{target} exists: setup does not replace a config",
                hint="`b70ctl setup --dry-run` shows what it would write; --force replaces it "
                "and keeps the old one beside it", code="config_exists",
            )  # fmt: skip
        if old is not None and old != text:
            doc["kept"] = keep_beside(target, old)
        write_atomic(target, text)
        doc["written"] = True

    def said() -> str:
        if dry_run:
            return text.rstrip("\n")
        lines = [
            f"wrote {target}" + (f" (the old one kept as {doc['kept']})" if doc["kept"] else "")
        ]
        lines += [f"left out: {x}" for x in left_out]
        return "\n".join([*lines, "next: sudo b70ctl install"])

    output.show(ctx.json, doc, said)


@gpu.command("wait-free")
@click.option(
    "--need-bytes", type=int, default=0, show_default=True, help="Memory the start needs."
)
@click.option("--need-gib", type=float, help="The same in GiB.")
@click.option(
    "--device",
    "devices",
    multiple=True,
    default=("auto",),
    show_default=True,
    help="PCI address, or auto; once per card the runtime runs on.",
)
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
    devices: tuple[str, ...],
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
    from appliance.host.gpu import fit

    if need_bytes < 0 or (need_gib is not None and not 0 <= need_gib <= 1024**2):
        raise ApplianceError(
            "--need-bytes and --need-gib must be between 0 and 1 PiB",
            code="usage_error",
            exit_code=2,
        )
    need = int(need_gib * GIB) if need_gib is not None else need_bytes
    fit.wait_start(gpu_root(root), devices, need, unit, timeout_s, guard_log)
    output.show(ctx.json, {"devices": list(devices), "need_bytes": need, "free": True})


@cli.group(hidden=True)
def unit() -> None:
    """Guards that the rendered units run around their main process (not for people)."""


@unit.command("pre")
@click.option("--port", type=int, required=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Where the runtime binds.")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=10.0)
@click.option(
    "--device",
    "devices",
    multiple=True,
    help="With --need-bytes: first wait as `gpu wait-free` does, on this card (once per card).",
)
@click.option("--need-bytes", type=click.IntRange(min=0), default=0, help="With --device.")
@click.option(
    "--unit", "unit_name", help="The unit about to start (its own memory does not count)."
)
@click.option(
    "--gpu-timeout",
    "gpu_timeout_s",
    type=click.FloatRange(min=0),
    default=120,
    help="With --device.",
)
@click.option("--engine", type=click.Choice([e.value for e in Engine]), help="With --cache.")
@click.option(
    "--cache",
    "cache",
    type=click.Path(path_type=Path),
    help="Last: the recipe's folder of the runtime's lasting cache, made and bounded.",
)
@click.option("--cache-max-bytes", type=click.IntRange(min=0), default=0, help="With --cache.")
@click.option(
    "--cache-var",
    "cache_vars",
    multiple=True,
    help="With --cache: a variable the unit points into the folder (once per variable).",
)
@root_option
@with_json
def unit_pre(
    ctx: Context,
    port: int,
    host: str,
    wait_s: float,
    devices: tuple[str, ...],
    need_bytes: int,
    unit_name: str | None,
    gpu_timeout_s: float,
    engine: str | None,
    cache: Path | None,
    cache_max_bytes: int,
    cache_vars: tuple[str, ...],
    root: Path | None,
) -> None:
    """ExecStartPre: the GPU memory the runtime needs is free (with --device), then the backend
    port is free, then its lasting cache is ready (with --cache). One process for the guards,
    so that a runtime's start waits for one b70ctl start, not three."""
    from appliance.units import guards

    if devices:
        from appliance.host.gpu import fit

        fit.wait_start(gpu_root(root), devices, need_bytes, unit_name, gpu_timeout_s, guard_log)
    guards.pre(port, wait_s, host)
    result: dict[str, object] = {"port": port, "free": True, "devices": list(devices)}
    if cache is not None and engine:
        found = guards.cache(cache, Engine(engine), cache_vars, cache_max_bytes)
        result["cache"] = {"verdict": found.verdict, "problem": found.problem or None}
    output.show(ctx.json, result)


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

    from appliance.units import guards

    try:
        port = urlsplit(url).port
    except ValueError:
        port = None
    if port is None:
        raise ApplianceError(f"--url {url} names no valid port", code="usage_error", exit_code=2)
    guards.ready(guards.ReadyTarget(url, engine, port, pid, container, container_cli))
    output.show(ctx.json, {"url": url, "ready": True})
