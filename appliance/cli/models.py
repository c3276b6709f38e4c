"""`b70ctl models`: the models named by their place on the hub (`model = "hf:..."`), pulled into
the models folder (`[models] dir`), listed, and removed. `uninstall --purge` never removes one."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import click

from appliance.cli import output
from appliance.cli.base import Context, cli, with_json
from appliance.config import Config, RuntimeConfig
from appliance.config.hub import PULLED, amount, pulled, pulled_files, write_pulled
from appliance.errors import ApplianceError

GIB = 1024**3


@cli.group()
def models() -> None:
    """Models from the Hugging Face hub: `model = "hf:OWNER/REPO"` (or hf:OWNER/REPO:QUANT,
    hf:OWNER/REPO/FILE.gguf) in a runtime's table, pulled into [models] dir.

    \b
    Example:
      sudo b70ctl models pull llamacpp
    """


def _hub_runtimes(config: Config, names: tuple[str, ...]) -> list[RuntimeConfig]:
    for name in names:
        rt = config.runtime(name)
        if rt.hub is None:
            raise ApplianceError(
                f"runtimes.{name}.model is {rt.model}, a path, not a model on the hub",
                hint='write model = "hf:OWNER/REPO" there to have it pulled, or put the files '
                "at that path yourself", code="not_a_hub_model",
            )  # fmt: skip
    chosen = [config.runtime(n) for n in names] if names else list(config.runtimes.values())
    seen, out = set(), []
    for rt in chosen:  # one pull per model, whichever runtimes share it
        if rt.hub is not None and str(rt.hub) not in seen:
            seen.add(str(rt.hub))
            out.append(rt)
    return out


class Bar:
    """The pull's progress on stderr: a line redrawn on a terminal, a line each 10% elsewhere."""

    def __init__(self, name: str) -> None:
        self.name, self.tty = name, sys.stderr.isatty()
        self.shown, self.start = -1, time.monotonic()

    def __call__(self, path: str, done: int, total: int) -> None:
        share = done / total if total else 1.0
        rate = done / max(time.monotonic() - self.start, 1e-3) / 1024**2
        line = f"{self.name}: {share:6.1%}  {amount(done)} of {amount(total)}  "
        line += f"{rate:.0f} MiB/s  {path}"
        if self.tty:
            print("\r" + line[:150].ljust(150), end="", file=sys.stderr, flush=True)
        elif int(share * 10) > self.shown:
            self.shown = int(share * 10)
            output.log(line)

    def end(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


@models.command("pull")
@click.argument("runtimes", nargs=-1)
@with_json
def pull(ctx: Context, runtimes: tuple[str, ...]) -> None:
    """Fetch the hub models of RUNTIMES (default: every runtime's), with the free space checked
    first, a cut download resumed, and each file checked against the hub's hash."""
    config = ctx.config()
    ctx.require_root("models pull")
    chosen = _hub_runtimes(config, runtimes)
    if not chosen:
        raise ApplianceError(
            "no runtime's model is on the hub", code="nothing_to_pull",
            hint='write model = "hf:OWNER/REPO" in a runtime\'s table to have it pulled',
        )  # fmt: skip
    done = fetch(config, chosen, ctx.json)
    quant = [rt.name for rt in chosen if rt.hub is not None and rt.hub.quant is not None]
    after = (
        f"\nnext: `sudo b70ctl install`, so that the unit of {', '.join(quant)} names the file "
        "pulled"
        if quant
        else ""
    )
    output.show(ctx.json, {"models": done}, lambda: _table(done) + after)


def fetch(config: Config, chosen: list[RuntimeConfig], quiet: bool) -> list[dict[str, Any]]:
    """Each runtime's hub model pulled, its size said first and a bar drawn on stderr (none when
    `quiet`, under --json); what each fetched."""
    from appliance.host import hub

    done = []
    with hub.client() as http:
        for rt in chosen:
            assert rt.hub is not None
            plan = hub.plan(rt.hub, config.models_dir, http)
            if not quiet:
                output.log(
                    f"{rt.name}: {rt.hub}, {len(plan.files)} files, {amount(plan.size_bytes)}, "
                    f"{amount(plan.to_fetch_bytes)} to fetch, into {plan.folder}"
                )
            bar = Bar(rt.name) if not quiet else None
            try:
                hub.pull(plan, http, bar)
            finally:
                if bar is not None:
                    bar.end()
            done.append(_entry(config, rt) | {"fetched_bytes": plan.to_fetch_bytes})
    return done


def _entry(config: Config, rt: RuntimeConfig) -> dict[str, Any]:
    assert rt.hub is not None
    folder = rt.hub.folder(config.models_dir)
    files = pulled_files(folder, rt.hub)
    return {
        "runtime": rt.name, "model": str(rt.hub), "path": rt.model, "pulled": bool(files),
        "bytes": sum(int(f.get("size") or 0) for f in files.values()),  # type: ignore[call-overload]
    }  # fmt: skip


def _table(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return 'no runtime\'s model is on the hub (model = "hf:OWNER/REPO")'
    rows = [["RUNTIME", "MODEL", "PULLED", "SIZE", "PATH"]]
    for e in entries:
        size = amount(e["bytes"]) if e["pulled"] else "-"
        rows.append([e["runtime"], e["model"], "yes" if e["pulled"] else "no", size, e["path"]])
    return output.table(rows)


@models.command("list")
@with_json
def list_(ctx: Context) -> None:
    """The runtimes' hub models: pulled or not, their size and path."""
    config = ctx.config()
    entries = [_entry(config, rt) for rt in _hub_runtimes(config, ())]
    output.show(ctx.json, {"models": entries}, lambda: _table(entries))


@models.command("rm")
@click.argument("runtime")
@with_json
def rm(ctx: Context, runtime: str) -> None:
    """Delete RUNTIME's pulled model: the files its pull recorded, and what a cut pull left."""
    config = ctx.config()
    ctx.require_root("models rm")
    (rt,) = _hub_runtimes(config, (runtime,))
    assert rt.hub is not None
    folder = rt.hub.folder(config.models_dir)
    record = pulled(folder)
    others = {str(f["path"]) for name, files in record.items() if name != str(rt.hub)
              for f in files}  # fmt: skip
    removed = []
    for path in pulled_files(folder, rt.hub):
        if path in others:  # another model pulled here has it too
            continue
        for name in (path, path + ".part"):
            target = folder / name
            if target.is_file():
                target.unlink()
                removed.append(str(target))
    if not others and folder.is_dir():
        for part in folder.rglob("*.part"):  # what a cut pull left
            part.unlink()
            removed.append(str(part))
    rest = {name: files for name, files in record.items() if name != str(rt.hub)}
    if not rest and (folder / PULLED).exists():
        removed.append(str(folder / PULLED))
    write_pulled(folder, rest)
    _prune(folder, Path(config.models_dir))
    output.show(ctx.json, {"removed": removed}, lambda: output.render_removed(removed))


def _prune(folder: Path, top: Path) -> None:
    """Empty folders, in `folder` and from it up to the models folder (not that)."""
    if folder.is_dir():
        inner = [p for p in folder.rglob("*") if p.is_dir()]
        for one in sorted(inner, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                one.rmdir()
    here = folder
    while here != top and top in here.parents:
        try:
            here.rmdir()
        except OSError:
            return
        here = here.parent


# --- what install fetches first ----------------------------------------------------------------


def missing_images(config: Config) -> list[tuple[str, str]]:
    """The container images the runtimes name that their engine does not have, asked as the
    switch's preflight asks: (engine, image). An engine that is not installed is left to doctor
    and to the pull."""
    from appliance import run
    from appliance.config import Launcher
    from appliance.units.runtimes import container_cli

    wanted = sorted({(container_cli(config, rt), rt.image) for rt in config.runtimes.values()
                     if rt.launcher is not Launcher.NATIVE and rt.image})  # fmt: skip
    out = []
    for engine, image in wanted:
        have = run.ask([engine, "image", "inspect", image], 30)
        if have is None or have.returncode != 0:
            out.append((engine, image))
    return out


def pull_image(engine: str, image: str, quiet: bool) -> None:
    """`ENGINE pull IMAGE`: on a terminal its own progress is drawn on stderr, elsewhere its
    lines go there; a failure is the appliance's error with the engine's last words."""
    import subprocess

    tty = sys.stderr.isatty() and not quiet
    if not quiet:
        output.log(f"pulling {image} with {Path(engine).name}")
    try:
        proc = subprocess.Popen(
            [engine, "pull", image],
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno() if tty else subprocess.PIPE,  # its progress, on stderr
            stderr=None if tty else subprocess.STDOUT,
            text=True,
        )
    except OSError as e:
        raise ApplianceError(
            f"cannot run {engine} to pull {image}: {e.strerror or e}",
            hint=f"install {Path(engine).name}, or name it at the top of the config",
            code="image_pull_failed",
        ) from None
    last: list[str] = []
    if proc.stdout is not None:
        for line in proc.stdout:
            last = [*last, line.rstrip()][-3:]
            if not quiet:
                output.log(line.rstrip())
    if proc.wait() != 0:
        errors = [x for x in last if x.lower().startswith("error")]
        said = (errors or [x for x in last if x] or [f"exit status {proc.returncode}"])[-1]
        raise ApplianceError(
            f"{Path(engine).name} pull {image} failed: {said}",
            hint="check the image's name and tag and that its registry is reachable "
            f"(`{Path(engine).name} login` for a private one); `install --no-pull` installs "
            "without it",
            code="image_pull_failed",
        )


def ready(ctx: Context, doctor_on: bool, pull_on: bool) -> Config:
    """What `install` does before it writes anything: doctor's checks, then the hub models and
    container images that are missing fetched, then the checks again. A failure stops it, each
    failed check with its fix; a failure that a fetch mends waits for the fetch, and the checks
    run again only after one."""
    from appliance.host import doctor as doctor_mod
    from appliance.host.gpu import sysroot
    from appliance.measure import recipe

    config = ctx.config()
    root = sysroot()

    def stop_on(failed_ones: list[Any], every: list[Any]) -> None:
        if not failed_ones:
            return
        if not ctx.json:
            output.log(output.render_checks([vars(c) for c in failed_ones]))
        raise ApplianceError(
            f"doctor: {len(failed_ones)} of {len(every)} checks failed: "
            + ", ".join(dict.fromkeys(c.name for c in failed_ones))
            + "; nothing was installed",
            hint="each FAIL line says how to fix it; then `sudo b70ctl install` again "
            "(`--no-doctor` installs without the checks)",
            code="doctor_failed",
            details={"checks": [vars(c) for c in every]},
        )

    def checks() -> list[Any]:
        return doctor_mod.doctor(config, root) + recipe.doctor_checks(config, root)

    found = checks() if doctor_on else []
    stop_on([c for c in found if not c.ok and not (pull_on and c.fetch)], found)
    if not pull_on:
        return config
    models = [rt for rt in _hub_runtimes(config, ())
              if rt.hub is not None and not rt.hub.is_pulled(config.models_dir)]  # fmt: skip
    images = missing_images(config)
    if not models and not images:  # nothing fetched: the checks stand as they were
        stop_on([c for c in found if not c.ok], found)
        return config
    if models:
        fetch(config, models, ctx.json)
    for engine, image in images:
        pull_image(engine, image, ctx.json)
    config = ctx.config()  # a quantization pulled names its file now
    found = checks() if doctor_on else []
    stop_on([c for c in found if not c.ok], found)
    return config
