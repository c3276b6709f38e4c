"""The commands that install the appliance and run it: render, install, uninstall, switch,
status, monitor, logs."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import click

from appliance.cli import output
from appliance.cli.base import Context, cli, with_json
from appliance.errors import ApplianceError


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
    from appliance.deploy.install import render_diff
    from appliance.files import write_atomic
    from appliance.layout import layout
    from appliance.units.render import render_all

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
@click.option(
    "--doctor/--no-doctor",
    default=None,
    help="Run doctor's checks first and stop on a failure "
    "(default: on for the system manager, off with --user).",
)
@click.option(
    "--pull/--no-pull",
    default=True,
    show_default=True,
    help="Fetch the hub models (hf:) and container images that are missing first.",
)
@click.option(
    "--warm/--no-warm",
    default=None,
    help="Start each runtime whose compile cache is cold once, then hand back to the default "
    "(default: on for the system manager, off with --user).",
)
@with_json
def install(ctx: Context, now: bool, doctor: bool | None, pull: bool, warm: bool | None) -> None:
    """Install the rendered units, then daemon-reload and enable them.

    First, on the system manager, doctor's checks: a failure stops it before anything is
    written, with the fix. The models named on the hub and the container images that are
    missing are fetched, with progress on stderr. Verifies the units with systemd-analyze and
    writes nothing if that fails. Creates the proxy's master key file (mode 0600) if it does
    not exist yet.

    \b
    Example:
      sudo b70ctl install
      b70ctl --user --config examples/demo.toml install
    """
    from appliance.cli.models import ready
    from appliance.deploy import install as install_mod
    from appliance.layout import Scope

    ctx.require_root("install")
    doctor_on = ctx.scope is Scope.SYSTEM if doctor is None else doctor
    config = ready(ctx, doctor_on, pull)
    result = install_mod.install(config, ctx.scope, now, output.progress)
    doc = dataclasses.asdict(result)
    if now and (ctx.scope is Scope.SYSTEM if warm is None else warm):
        # each runtime's first start compiles: done now, not when a client first asks for it
        from appliance.deploy import warm as warm_mod

        warmed = warm_mod.warm(config, ctx.scope, output.progress)
        doc["warm"] = dataclasses.asdict(warmed)
        doc["notes"] += [
            f"{name} is warm: started once now, its cache kept" for name in warmed.warmed
        ]
        doc["notes"] += [f"{name} is still cold: {why}" for name, why in warmed.cold.items()]
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
    from appliance.deploy import install as install_mod

    ctx.require_root("uninstall")
    result = install_mod.uninstall(ctx.config(), ctx.scope, purge)
    data = dataclasses.asdict(result)
    output.show(ctx.json, data, lambda: output.render_removed(result.removed, result.kept))


@cli.command()
@click.argument("name")
@click.option("--restart", is_flag=True, help="Restart NAME even if it is already serving.")
@click.option("--gate", is_flag=True, help="Run the validity gates before the switch counts.")
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    help="Seconds to wait for the old runtime's requests to finish (default: [proxy] drain_s).",
)
@click.option(
    "--pin",
    metavar="DURATION",
    help="Keep NAME serving against switches on demand for this long (30m, 2h, 1d).",
)
@with_json
def switch(
    ctx: Context,
    name: str,
    restart: bool,
    gate: bool,
    drain_timeout: float | None,
    pin: str | None,
) -> None:
    """Make runtime NAME the one serving, or roll back to the previous one and fail.

    New requests wait at the proxy while the old runtime finishes what it has in flight, stops,
    and NAME starts; clients see a slower answer, not an error. A switch by hand ends a pin on
    another runtime; with --pin, demand ([switching] on_demand) does not swap NAME out until
    the pin ends or `b70ctl unpin`.

    \b
    Example:
      sudo b70ctl switch llamacpp
      sudo b70ctl switch vllm --pin 2h
    """
    from appliance.layout import layout
    from appliance.switch import apply
    from appliance.switch.demand import pins
    from appliance.units import serving as units

    ctx.require_root("switch")
    pin_s = pins.parse_duration(pin) if pin is not None else None
    progress: units.Progress = (
        output.progress if sys.stderr.isatty() or not ctx.json else units.no_progress
    )
    line = None
    if sys.stderr.isatty() and not ctx.json:  # a terminal: one line that moves
        from appliance.cli import live

        progress = line = live.Live(sys.stderr, live.journal_tail(ctx.scope))
    try:
        result = apply.switch(
            ctx.config(), ctx.scope, name, restart, progress, gate, drain_s=drain_timeout
        )
    finally:
        if line is not None:
            line.close()
    data = dataclasses.asdict(result)
    data.pop("journal")
    state_dir = layout(ctx.scope).state_dir
    held = pins.read_pin(state_dir)
    if pin_s is not None:
        until = time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime(pins.write_pin(state_dir, name, pin_s).until)
        )
        data["notes"].append(f"pinned for {pin}: demand does not swap {name} out until {until}")
    elif held is not None and held.runtime != name:
        pins.clear_pin(state_dir)
        data["notes"].append(f"the pin on {held.runtime} ended with this switch by hand")
    output.show(ctx.json, data, lambda: output.render_switch(data))


@cli.command()
@with_json
def unpin(ctx: Context) -> None:
    """End a pin (`b70ctl switch NAME --pin`): switches on demand may swap its runtime out again.

    \b
    Example:
      sudo b70ctl unpin
    """
    from appliance.layout import layout
    from appliance.switch.demand import pins

    ctx.require_root("unpin")
    ctx.config()  # the appliance it is: a broken config is said, not passed over
    held = pins.clear_pin(layout(ctx.scope).state_dir)
    data = {"unpinned": held.runtime if held else None}
    output.show(
        ctx.json, data, lambda: f"{held.runtime} is no longer pinned" if held else "no pin held"
    )


@cli.command()
@with_json
def status(ctx: Context) -> None:
    """Show which runtime serves, every b70 unit, health, and the last switch.

    \b
    Example:
      b70ctl status --json | jq .result.active_runtime
    """
    from appliance.watch import status as status_mod

    result = status_mod.status(ctx.config(), ctx.scope)
    output.show(ctx.json, result, lambda: output.render_status(result))


@cli.command()
@click.option(
    "--once", is_flag=True, help="Take one sample, act on it, print it and exit (no metrics port)."
)
@with_json
def monitor(ctx: Context, once: bool) -> None:
    """Watch the serving runtime: restart it when it hangs, fail over when it does not come back.

    Runs as b70-monitor.service. Samples backend and proxy health, a probe completion, GPU
    memory and the runtime's metrics every [monitor] interval_s, keeps the last hour of samples,
    and serves the status page (/) and Prometheus metrics (/metrics) on [monitor] host:port.

    \b
    Example:
      b70ctl monitor --once && curl -s http://127.0.0.1:9101/metrics | grep ^b70_
    """
    from appliance.watch import monitor as monitor_mod

    ctx.require_root("monitor")
    if ctx.json and not once:
        raise ApplianceError(
            "monitor runs until it is stopped; --json prints one sample",
            hint="add --once",
            code="usage_error",
            exit_code=2,
        )
    sample = monitor_mod.run(ctx.config(), ctx.scope, output.log, once=once)
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
    from appliance.layout import MONITOR_UNIT, PROXY_UNIT
    from appliance.units import systemd

    if lines < 1:
        raise ApplianceError(
            f"--lines {lines}: must be at least 1", code="usage_error", exit_code=2
        )
    config = ctx.config()
    systemd.require_journal(ctx.scope)
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
