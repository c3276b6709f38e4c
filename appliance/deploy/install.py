"""Render and install: verify, write atomically, reload, enable, start; and uninstall."""

from __future__ import annotations

import difflib
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from appliance import run
from appliance.config import Config
from appliance.deploy import certificate
from appliance.deploy.purge import purge_state
from appliance.deploy.warm import hold_warnings
from appliance.engines import lasting
from appliance.errors import ApplianceError
from appliance.files import write_atomic
from appliance.host.placement import excludes
from appliance.keys import ensure_key
from appliance.layout import (
    MONITOR_UNIT,
    PROXY_CONFIG,
    PROXY_SOCKET,
    PROXY_UNIT,
    SYSUSERS,
    UNIT_SUFFIXES,
    Layout,
    Scope,
    cache_name,
    layout,
)
from appliance.switch.lock import writer_lock
from appliance.switch.preflight import not_pulled, recipe_warnings
from appliance.switch.recovery import recover_killed
from appliance.units import systemd
from appliance.units.render import cache_recipes, recipe_folder, render_all
from appliance.units.rendered import stamp
from appliance.units.serving import (
    RUNNING,
    Progress,
    active_runtimes,
    check_port,
    no_progress,
    wait_started,
    wait_stopped,
)


def render_diff(config: Config, scope: Scope) -> str:
    lay = layout(scope)
    chunks: list[str] = []
    for name, text in render_all(config, lay).items():
        dest = lay.destination(name)
        try:
            current = dest.read_text().splitlines(keepends=True)
        except FileNotFoundError:
            current = []
        chunks += difflib.unified_diff(
            current, text.splitlines(keepends=True), str(dest), f"{dest} (rendered)"
        )
    return "".join(chunks)


def verify_units(files: dict[str, str], scope: Scope) -> None:
    """`systemd-analyze verify` on the rendered units; any output at all is a failure."""
    with tempfile.TemporaryDirectory(prefix="b70-verify.") as tmp:
        paths = []
        for name, text in files.items():
            if name.endswith(UNIT_SUFFIXES):
                (Path(tmp) / name).write_text(text)
                paths.append(str(Path(tmp) / name))
        argv = ["systemd-analyze", "verify", "--man=no"]
        if scope is Scope.USER:
            argv.insert(1, "--user")
        env = dict(os.environ)
        env.setdefault("XDG_RUNTIME_DIR", tmp)  # --user verify needs one, not a running manager
        out = run.run(
            argv + paths, timeout_s=60, hint="install systemd", env=env, code="verify_failed"
        )
        text = (out.stdout + out.stderr).replace(tmp + "/", "")
        if out.returncode != 0 or text.strip():
            raise ApplianceError(
                "the rendered units do not pass `systemd-analyze verify`; nothing was installed:\n"
                + text.strip(),
                hint="fix what it names in the config (a missing executable, a bad value)",
                code="verify_failed",
            )


@dataclass
class ConfigChange:
    """What install did to the installed config: the diff, and where the previous file went."""

    path: str
    diff: str
    backup: str | None


def install_config(config: Config, lay: Layout, now: float | None = None) -> ConfigChange | None:
    """Keep the config the units came from where they (and b70ctl without --config) find it.

    A different file already there is never lost: it is kept beside it as a dated backup, and
    the change is reported as a diff.
    """
    try:
        current: str | None = lay.config.read_text(errors="replace")
    except FileNotFoundError:
        current = None
    if current == config.text:
        return None
    backup = keep_beside(lay.config, current, now) if current is not None else None
    diff = "".join(
        difflib.unified_diff(
            (current or "").splitlines(keepends=True),
            config.text.splitlines(keepends=True),
            f"{lay.config} (installed)",
            f"{config.path}",
        )
    )
    write_atomic(lay.config, config.text)
    return ConfigChange(str(lay.config), diff, backup)


def keep_beside(path: Path, text: str, now: float | None = None) -> str:
    """A file about to be replaced, kept beside it as PATH.DATE.bak: the backup's path."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    candidate = path.with_name(f"{path.name}.{stamp}.bak")
    n = 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{stamp}-{n}.bak")
    write_atomic(candidate, text, mode=path.stat().st_mode & 0o777)
    return str(candidate)


def create_users(sysusers_file: Path) -> None:
    """systemd-sysusers creates the runtimes' users and adds them to the render group."""
    out = run.run(
        ["systemd-sysusers", str(sysusers_file)],
        timeout_s=60,
        hint="install systemd",
        code="install_failed",
    )
    if out.returncode != 0:
        raise ApplianceError(
            f"systemd-sysusers could not create the runtime users: {out.stderr.strip()}",
            hint=f"check {sysusers_file}",
            code="install_failed",
        )


RENDERED_MARK = "# Rendered by b70ctl"  # the first line of every unit b70ctl writes


def dropped_units(files: dict[str, str], lay: Layout) -> list[str]:
    """Installed b70 units that this config no longer renders: runtimes taken out of it.

    Only files b70ctl wrote itself (its first line says so) are named; a unit of the user's own
    that happens to be called b70-*.service is left alone."""
    found = []
    for path in sorted(lay.unit_dir.glob("b70-*")):
        if path.name in files or not path.name.endswith(UNIT_SUFFIXES):
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                first = f.readline()
        except OSError:
            continue
        if first.startswith(RENDERED_MARK):
            found.append(path.name)
    return found


@dataclass
class InstallResult:
    scope: str
    written: list[str]
    unchanged: list[str]
    key_created: bool
    enabled: list[str]
    started: list[str]
    notes: list[str] = field(default_factory=list)
    config: ConfigChange | None = None
    removed: list[str] = field(default_factory=list)
    boot_runtime: str = ""  # the runtimes enabled at boot (", "), started if none runs
    boot_runtimes: list[str] = field(default_factory=list)
    tls: certificate.Certificate | None = None  # the certificate the proxy serves (TLS on)


def install(
    config: Config, scope: Scope, now: bool, progress: Progress = no_progress
) -> InstallResult:
    """Verify, write, reload, enable; with `now`, start what should run."""
    lay = layout(scope)
    files = render_all(config, lay)
    verify_units(files, scope)  # before anything is written
    certificate.check_given(config, lay)
    changed = changed_files(files, lay)
    with writer_lock(lay.state_dir, "install") as lock, systemd.connect(scope) as sd:
        if now:  # what would keep the units from starting, before anything is written
            if sd.properties(PROXY_SOCKET).active_state != "active":  # else systemd holds it for us
                check_port(sd, [PROXY_UNIT], config.proxy.port, "proxy")
            runtime_units = [rt.unit for rt in config.runtimes.values()]
            for port in sorted({rt.port for rt in config.runtimes.values()}):
                check_port(sd, runtime_units, port, "backend", config)
        result = _write(config, lay, sd, files, changed, progress)
        result.notes += recipe_warnings(config)
        result.notes += hold_warnings(config, lay)
        if lock.stale is not None:  # a killed switch: settled before anything starts
            done = recover_killed(config, lay, sd, lock.stale, progress, wait=now)
            if done is not None:
                result.notes.append(done)
                lock.clear_stale()
        if now:
            _start_proxy(sd, changed, result, progress)
            _start_monitor(sd, MONITOR_UNIT in changed or result.config is not None, result)
            _start_runtime(config, sd, changed, result, progress)
        return result


def _write(
    config: Config,
    lay: Layout,
    sd: systemd.Systemd,
    files: dict[str, str],
    changed: dict[str, str],
    progress: Progress,
) -> InstallResult:
    """The files written, the runtimes taken out of the config removed, the units enabled."""
    key_created = ensure_key(lay)
    lay.state_dir.mkdir(parents=True, exist_ok=True)
    dropped = dropped_units(files, lay)
    for unit in dropped:  # before the new units start: they may share its port and GPU
        progress("removing", f"{unit} (not in the config any more)")
        sd.stop(unit)
        wait_stopped(sd, unit, 300)
    if dropped:
        sd.disable(dropped)
        for unit in dropped:
            lay.destination(unit).unlink(missing_ok=True)
            sd.reset_failed(unit)
    for name, text in changed.items():
        write_atomic(lay.destination(name), text)
    removed_caches = prune_caches(config, lay, sd, dropped, progress)
    config_change = install_config(config, lay)
    stamp(config, lay, files)
    if SYSUSERS in changed:
        create_users(lay.destination(SYSUSERS))
    tls = certificate.ensure(config, lay)  # after the proxy's user is made: its key is theirs
    sd.reload()
    runtime_units = [rt.unit for rt in config.runtimes.values()]
    enabled = [u for u in runtime_units if sd.properties(u).unit_file_state == "enabled"]
    to_enable = [PROXY_SOCKET, PROXY_UNIT, MONITOR_UNIT]
    # The runtimes enabled at boot, by name, less any that shares a card with one before it
    # (systemd would start only one of two that conflict): side by side, or replicas.
    boot: list[str] = []
    for _, rt in sorted(config.runtimes.items()):
        if rt.unit in enabled and not any(excludes(rt, config.runtime(b)) for b in boot):
            boot.append(rt.name)
    boot = boot or list(config.members(config.default_runtime))
    to_enable += [] if enabled else [config.runtime(name).unit for name in boot]
    sd.enable(to_enable)
    return InstallResult(
        scope=lay.scope.value,
        written=[str(lay.destination(n)) for n in changed],
        unchanged=[str(lay.destination(n)) for n in files if n not in changed],
        key_created=key_created,
        enabled=to_enable,
        started=[],
        config=config_change,
        removed=[str(lay.destination(u)) for u in dropped],
        notes=[f"removed {p}: the cache of a recipe no longer installed" for p in removed_caches],
        boot_runtime=", ".join(boot),
        boot_runtimes=boot,
        tls=tls,
    )


def prune_caches(
    config: Config, lay: Layout, sd: systemd.Systemd, dropped: list[str], progress: Progress
) -> list[str]:
    """The lasting caches of recipes no longer installed (appliance.engines.lasting), and of
    runtimes taken out of the config. A runtime that runs keeps its folder until the next
    install: its engine may still write there."""
    keep = cache_recipes(config)
    removed = []
    for unit in dropped:
        if (gone := remove_cache(lay, unit, [])) is not None:  # a failure: kept for next time
            removed.append(gone)
    for rt in config.runtimes.values():
        name = cache_name(rt.unit)
        if name not in keep or sd.properties(rt.unit).active_state in ("active", "activating"):
            continue
        for folder in lasting.prune(lay.cache_root / name, {keep[name]}):
            progress("removing", f"{folder} (the cache of a recipe no longer installed)")
            removed.append(str(folder))
    return removed


def _start_proxy(
    sd: systemd.Systemd, changed: dict[str, str], result: InstallResult, progress: Progress
) -> None:
    """The proxy started, or restarted when what it runs changed."""
    proxy_changed = PROXY_UNIT in changed or PROXY_CONFIG in changed
    proxy_changed |= result.tls is not None and result.tls.new  # a new certificate to serve
    if PROXY_SOCKET in changed and sd.properties(PROXY_SOCKET).active_state == "active":
        # A new address: the socket is bound again. Stopping it stops the proxy (Requires=),
        # which is then started below, with the new socket.
        progress("restarting", PROXY_SOCKET)
        sd.stop(PROXY_SOCKET)
        for unit in (PROXY_UNIT, PROXY_SOCKET):
            wait_stopped(sd, unit, 120)
        sd.start(PROXY_SOCKET)
    state = sd.properties(PROXY_UNIT).active_state
    if state == "active" and not proxy_changed:
        return
    # Still starting counts as running: a start begun before this install wrote the unit (the
    # socket's first client, the manager's boot) runs the old command, and a start would only
    # wait for it.
    restart = state in RUNNING and proxy_changed
    progress("restarting" if restart else "starting", PROXY_UNIT)
    if restart:
        sd.restart(PROXY_UNIT)
    else:
        sd.reset_failed(PROXY_UNIT)
        sd.start(PROXY_UNIT)
    wait_started(sd, PROXY_UNIT, 180, progress)
    result.started.append(PROXY_UNIT)


def _start_monitor(sd: systemd.Systemd, changed: bool, result: InstallResult) -> None:
    """The monitor started, or restarted when its unit or the config changed."""
    state = sd.properties(MONITOR_UNIT).active_state
    if state == "active" and not changed:
        return
    if state in RUNNING and changed:  # one starting runs the old unit too (_start_proxy)
        sd.restart(MONITOR_UNIT)
    else:
        sd.reset_failed(MONITOR_UNIT)
        sd.start(MONITOR_UNIT)
    result.started.append(MONITOR_UNIT)


def _start_runtime(
    config: Config,
    sd: systemd.Systemd,
    changed: dict[str, str],
    result: InstallResult,
    progress: Progress,
) -> None:
    """The runtime enabled at boot started if none runs; a running one that changed is left
    running, with a note on how to apply the change."""
    active = active_runtimes(config, sd)
    for name in active:
        unit = config.runtime(name).unit
        if unit in changed:
            result.notes.append(
                f"{unit} changed while it runs; `b70ctl switch {name} --restart` applies it"
            )
    if active:
        return
    boot = []
    for name in result.boot_runtimes:  # one whose model is not pulled would only fail
        if (missing := not_pulled(config, config.runtime(name))) is not None:
            result.notes.append(
                f"{config.runtime(name).unit} not started: its model {missing}; "
                f"`sudo b70ctl models pull {name}` fetches it, then `b70ctl switch {name}`"
            )
        else:
            boot.append(name)
    for name in boot:  # several: side by side, or the replicas of one
        rt = config.runtime(name)
        progress("starting", rt.unit)
        sd.reset_failed(rt.unit)
        sd.start(rt.unit)
    for name in boot:
        rt = config.runtime(name)
        try:
            wait_started(sd, rt.unit, rt.start_timeout_s + 60, progress)
        except ApplianceError as e:
            sd.stop(rt.unit)  # do not leave it retrying in the background
            journal = " ".join(systemd.journal_command(sd.scope, rt.unit, 50))
            e.message = f"installed, but {e.message}"
            e.hint = f"see why: {journal}; then `b70ctl switch {rt.name}`"
            raise
        result.started.append(rt.unit)
        lasting.mark_started(recipe_folder(config, layout(sd.scope), rt))  # its cache is kept


def uninstall(config: Config, scope: Scope, purge: bool) -> UninstallResult:
    """Stop, disable and remove the units; with `purge`, the key, the units' caches and the
    appliance's own files in the state directory (appliance.deploy.purge), never anyone else's."""
    lay = layout(scope)
    units = [rt.unit for rt in config.runtimes.values()] + [PROXY_SOCKET, PROXY_UNIT, MONITOR_UNIT]
    result = UninstallResult()
    with writer_lock(lay.state_dir, "uninstall"), systemd.connect(scope) as sd:
        loaded = [u for u in units if sd.properties(u).load_state != "not-found"]
        for unit in loaded:
            sd.stop(unit)
        for unit in loaded:
            wait_stopped(sd, unit, 300)
        sd.disable([u for u in loaded if lay.destination(u).exists()])
        # The system users stay (as a removed Debian package leaves its users); the file that
        # makes them at each boot goes.
        made = [SYSUSERS] if lay.scope is Scope.SYSTEM else []
        for name in [*units, PROXY_CONFIG, *made]:
            path = lay.destination(name)
            if path.exists():
                path.unlink()
                result.removed.append(str(path))
        if purge:
            _purge(units, lay, result)
        sd.reload()
        for unit in units:
            sd.reset_failed(unit)
    if result.failed:
        raise ApplianceError(
            "uninstalled, but these files of the appliance could not be removed: "
            + "; ".join(result.failed),
            hint="remove them by hand (a read-only mount?); nothing else was left half-way",
            code="purge_incomplete",
            details={"removed": result.removed, "kept": result.kept},
        )
    return result


def remove_cache(lay: Layout, unit: str, failed: list[str]) -> str | None:
    """A unit's CacheDirectory= (compiled kernels, LiteLLM's), removed; its path where it went
    whole, else what could not go is added to `failed`."""
    cache = lay.cache_root / cache_name(unit)
    if not (unit.endswith(".service") and cache.is_dir() and not cache.is_symlink()):
        return None
    before = len(failed)
    shutil.rmtree(cache, onerror=lambda _f, p, e: failed.append(f"{p}: {e[1]}"))
    return str(cache) if len(failed) == before else None  # else the failures name what is left


def _purge(units: list[str], lay: Layout, result: UninstallResult) -> None:
    for unit in units:
        if (cache := remove_cache(lay, unit, result.failed)) is not None:
            result.removed.append(cache)
    if lay.key_file.exists():
        lay.key_file.unlink()
        result.removed.append(str(lay.key_file))
    purged = purge_state(lay.state_dir)
    result.removed += purged.removed
    result.kept += purged.kept
    result.failed += purged.failed


@dataclass
class UninstallResult:
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # in the state directory, not the appliance's
    failed: list[str] = field(default_factory=list)


def changed_files(files: Mapping[str, str], lay: Layout) -> dict[str, str]:
    """The subset of `files` whose installed copy is missing or different."""
    out = {}
    for name, text in files.items():
        dest = lay.destination(name)
        try:
            current = dest.read_text()
        except FileNotFoundError:
            current = None
        if current != text:
            out[name] = text
    return out
