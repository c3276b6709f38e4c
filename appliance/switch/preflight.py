"""A switch's preflight: everything it needs, checked before anything is touched."""

from __future__ import annotations

import os
import time

from appliance.config import Config, Engine, Launcher, RuntimeConfig
from appliance.config.hub import amount
from appliance.errors import ApplianceError
from appliance.host import gpu, placement
from appliance.host.gpu import fit
from appliance.layout import PROXY_CONFIG, PROXY_UNIT, Layout
from appliance.units import runtimes, systemd
from appliance.units.rendered import installed_as_rendered
from appliance.units.serving import check_port, container_pids


def preflight(config: Config, lay: Layout, sd: systemd.Systemd, target: RuntimeConfig) -> list[str]:
    """Check the target without touching anything. Returns notes; raises on the first problem."""
    notes: list[str] = []
    check_installed(config, lay, (target.unit, PROXY_UNIT, PROXY_CONFIG))
    if sd.load_state(target.unit) != "loaded":
        raise _preflight(f"systemd has not loaded {target.unit}", "run `b70ctl install`")
    check_runtime_files(config, target)
    check_port(sd, [rt.unit for rt in config.runtimes.values()], target.port, "backend", config)
    if proxy_settled(sd) != "active":
        raise _preflight(
            f"the proxy {PROXY_UNIT} is not active, so no switch could be verified",
            f"start it: {systemd.systemctl_command(lay.scope)} start {PROXY_UNIT}",
        )
    snap = gpu.snapshot(gpu.sysroot())
    notes += recipe_fits(target, snap)
    verdicts = memory_verdicts(config, target, snap)
    verdict = next((v for v in verdicts if not v.ok), verdicts[0])
    if not verdict.ok:
        raise ApplianceError(
            f"{target.name} would not have enough GPU memory: {verdict.reason}",
            hint="stop that process first; `b70ctl gpu` shows every holder",
            code="gpu_memory_busy",
        )
    notes += [f"GPU memory: {v.reason}" for v in dict.fromkeys(verdicts)]
    return notes


def on_a_gpu(rt: RuntimeConfig, snap: gpu.Snapshot) -> bool:
    """Whether a runtime runs on an Intel GPU: the host has one, or the runtime is given one."""
    return bool(snap.devices) or any(d.startswith("/dev/dri") for d in rt.devices)


def recipe_fits(target: RuntimeConfig, snap: gpu.Snapshot) -> list[str]:
    """A vLLM runtime on a GPU whose recipe cannot hold one request of its max model length is
    refused here, not after minutes of loading (appliance.measure.recipe); notes otherwise."""
    if target.engine is not Engine.VLLM or not on_a_gpu(target, snap):
        return []
    from appliance.measure import recipe

    fit = recipe.check(target)
    if fit is None:
        return []
    if not fit.ok:
        raise ApplianceError(fit.detail, hint=fit.fix, code="recipe_does_not_fit")
    return list(fit.notes)


def recipe_warnings(config: Config) -> list[str]:
    """`install`'s warnings: each vLLM runtime on a GPU whose recipe cannot fit, with the fix."""
    snap = gpu.snapshot(gpu.sysroot())
    out = []
    for rt in sorted(config.runtimes.values(), key=lambda r: r.name):
        try:
            recipe_fits(rt, snap)
        except ApplianceError as e:
            out.append(f"warning: {e.message}; {e.hint}")
    return out


def memory_verdicts(config: Config, target: RuntimeConfig, snap: gpu.Snapshot) -> list[fit.Verdict]:
    """Whether the target fits on each of its own cards once every appliance runtime has stopped,
    the memory its unit's GPU-memory guard will wait for: a holder there is found now, before
    the old runtime stops."""
    placed = placement.placements(config)
    devices = placement.devices_of(config, target, placed[target.name] if placed else None)
    ours = container_pids(config)
    return [fit.judge_switch(snap, d, target.memory_needed_bytes, ours) for d in devices]


def check_installed(config: Config, lay: Layout, names: tuple[str, ...]) -> None:
    """The installed files `names` are what the config renders. Known from install's stamp when
    nothing changed since (rendering would put jinja2's import on the switch's way); else
    rendered and compared, which names the first file that differs."""
    if installed_as_rendered(config, lay, names):
        return
    from appliance.units.render import render_all

    files = render_all(config, lay)
    for name in names:
        dest = lay.destination(name)
        try:
            current = dest.read_text()
        except FileNotFoundError:
            raise _preflight(f"{dest} is not installed", "run `b70ctl install`") from None
        if current != files[name]:
            raise _preflight(
                f"{dest} differs from what {config.path} renders",
                "run `b70ctl render --diff` to see how, then `b70ctl install`",
            )


# How long a switch waits for a proxy on its way up or back (systemd restarting it after a crash, or
# a start the operator began): LiteLLM's start takes about 15 s on the demo's CPU.
PROXY_SETTLE_S = 120.0
SIZE_ASK_S = 5.0  # how long the hub is asked a missing model's size, at most
IN_TRANSIT = ("activating", "deactivating", "reloading")


def proxy_settled(sd: systemd.Systemd, timeout_s: float = PROXY_SETTLE_S) -> str:
    """The proxy's state once it is no longer on its way somewhere, or after `timeout_s`: a switch
    asked while systemd restarts the proxy waits for it, and refuses only one that stays down."""
    deadline = time.monotonic() + timeout_s
    state = sd.active_state(PROXY_UNIT)
    while state in IN_TRANSIT and (left := deadline - time.monotonic()) > 0:
        sd.wait_change(min(left, 1.0))
        state = sd.active_state(PROXY_UNIT)
    return state


def _preflight(message: str, hint: str) -> ApplianceError:
    return ApplianceError(message, hint=hint, code="preflight_failed")


def check_runtime_files(config: Config, rt: RuntimeConfig) -> None:
    where = f"runtimes.{rt.name}"
    if (missing := not_pulled(config, rt)) is not None:
        raise _preflight(
            f"{where}.model: {missing}",
            f"run `sudo b70ctl models pull {rt.name}` (it fetches it into {config.models_dir})",
        )
    if rt.launcher is Launcher.NATIVE:
        exe = rt.command[0]
        if os.path.isabs(exe):
            found: str | None = exe
        else:  # named without its directory: look it up on PATH
            import shutil

            found = shutil.which(exe)
        if not found or not os.access(found, os.X_OK):
            raise _preflight(
                f"{where}.command: {exe} is not an executable file", "install it or fix the path"
            )
        for key, path in (("model", rt.model), ("mmproj", rt.mmproj)):
            if (
                path
                and (os.path.isabs(path) or rt.engine is Engine.LLAMACPP)
                and not os.path.exists(path)
            ):
                raise _preflight(
                    f"{where}.{key}: {path} does not exist", "download it or fix the path"
                )
    else:
        cli = runtimes.container_cli(config, rt)
        from appliance import run  # subprocess: only for a runtime in a container

        out = run.run(
            [cli, "image", "inspect", rt.image or ""],
            timeout_s=30,
            hint=f"install {rt.launcher}, or check that its daemon answers",
            code="preflight_failed",
        )
        if out.returncode != 0:
            raise _preflight(
                f"{where}.image: {rt.image} is not present in {rt.launcher}",
                f"pull it first: {cli} pull {rt.image}",
            )


def not_pulled(config: Config, rt: RuntimeConfig) -> str | None:
    """ "hf:... is not pulled yet (SIZE to fetch)" for a hub model not pulled, else None."""
    if rt.hub is None or rt.hub.is_pulled(config.models_dir):
        return None
    return f"{rt.hub} is not pulled yet{_size_of(config, rt)}"


def _size_of(config: Config, rt: RuntimeConfig) -> str:
    """ ", SIZE GiB to fetch", as the hub says it, or nothing when the hub cannot say."""
    from appliance.host import hub

    assert rt.hub is not None
    try:
        with hub.client(timeout_s=SIZE_ASK_S) as http:
            plan = hub.plan(rt.hub, config.models_dir, http)
    except ApplianceError:
        return ""
    return f" ({amount(plan.to_fetch_bytes)} to fetch)"
