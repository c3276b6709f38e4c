"""Render the units and the proxy config from one Config.

Rendering is pure: data in, {file name: text} out. Install writes the files, each with
appliance.files.write_atomic.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from appliance import engines
from appliance.engines import lasting
from appliance.host import placement
from appliance.units import runtimes, sandbox

if TYPE_CHECKING:
    import jinja2

    from appliance.host.gpu.sysfs import Device
from appliance.config import LOOPBACK_NAMES, BackendConfig, Config, Launcher, RuntimeConfig
from appliance.hold import PEER_HEADER
from appliance.keys import tls_files
from appliance.layout import (
    MONITOR_UNIT,
    PROXY_CONFIG,
    PROXY_SOCKET,
    PROXY_UNIT,
    SYSUSERS,
    Layout,
    Scope,
    cache_name,
)
from appliance.units.rendered import TEMPLATES

RESTART_SEC = 5


# --- systemd quoting ---------------------------------------------------------------------------

_SAFE_WORD = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")


Verbatim = runtimes.Verbatim
MAINPID = Verbatim("${MAINPID}")


def quote_exec_arg(arg: str) -> str:
    """One argv word as systemd's ExecStart= parser reads it back unchanged."""
    if isinstance(arg, Verbatim):
        return str(arg)
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _SAFE_WORD.match(arg) and arg != ";":
        return escaped
    escaped = escaped.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _render(template: str, lay: Layout, **values: object) -> str:
    """One template, told where the config the units come from is installed."""
    return _environment().get_template(template).render(config_path=lay.config, **values)


def render_exec(argv: list[str]) -> str:
    return " ".join(quote_exec_arg(a) for a in argv)


def render_environment(key: str, value: str) -> str:
    """An Environment= value: quoted, with backslashes, quotes and specifiers escaped (a
    Verbatim value's specifiers are left for systemd to expand)."""
    text = f"{key}={value}".replace("\\", "\\\\").replace('"', '\\"')
    if not isinstance(value, Verbatim):
        text = text.replace("%", "%%")
    return f'"{text}"'


def render_comment(text: str) -> list[str]:
    """A comment's lines, wrapped so that the unit file stays readable."""
    return [f"# {line}" for line in textwrap.wrap(text, 96)]


def render_seconds(value: float) -> str:
    return f"{value:g}s"


@functools.cache
def _environment() -> jinja2.Environment:
    import jinja2  # only rendering needs it; status and the units' guards do not

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["exec"] = render_exec
    env.filters["seconds"] = render_seconds
    env.filters["json"] = json.dumps
    env.filters["comment"] = render_comment
    return env


# --- rendering ---------------------------------------------------------------------------------


def conflicting(config: Config, runtime: RuntimeConfig) -> list[RuntimeConfig]:
    """Every other runtime that needs one of its cards (with no cards named, every other)."""
    return [
        other
        for name, other in sorted(config.runtimes.items())
        if name != runtime.name and placement.excludes(runtime, other)
    ]


def render_runtime_unit(
    config: Config, runtime: RuntimeConfig, lay: Layout, cards: list[placement.Card] | None = None
) -> str:
    """`cards`: where the runtime runs, when the config names cards (see `placements`)."""
    others = conflicting(config, runtime)
    sel = placement.selection(runtime, cards) if cards else None
    # One After= per pair, on the unit whose name sorts later: the earlier one is then fully
    # stopped before the later one starts, and the reverse holds as well. After= on both sides
    # would make `systemctl stop A B` a cyclic transaction.
    after = [o.unit for o in others if o.name < runtime.name]
    pre: list[list[str]] = []
    if runtime.launcher is not Launcher.NATIVE:
        pre.append(
            [
                "-" + a if i == 0 else a
                for i, a in enumerate(runtimes.exec_stop_post(config, runtime)[0])
            ]
        )
    # One process for both guards: the GPU memory (as `b70ctl gpu wait-free`), then the port.
    guard = [config.b70ctl, "unit", "pre", "--port", str(runtime.port)]
    if config.backend.host != BackendConfig.host:  # the port guard's own default
        guard += ["--host", config.backend.host]
    for device in placement.devices_of(config, runtime, cards):
        guard += ["--device", device]
    guard += ["--need-bytes", str(runtime.memory_needed_bytes), "--unit", runtime.unit]
    guard += ["--gpu-timeout", f"{config.gpu.release_timeout_s:g}"]
    # Then its lasting cache (appliance.engines.lasting): the recipe's folders, the size bound
    cached = runtimes.cache_env(runtime, sel)
    guard += ["--engine", runtime.engine.value, "--cache", runtimes.recipe_on_host(runtime, sel)]
    guard += ["--cache-max-bytes", str(runtime.cache_max_bytes)]
    for name in sorted(engines.of(runtime.engine).folders):
        if name in cached:
            guard += ["--cache-var", name]
    pre.append(guard)
    post = [config.b70ctl, "unit", "ready", "--url", runtimes.backend_url(config, runtime)]
    post += ["--engine", runtime.engine.value, "--pid", MAINPID]
    if runtime.launcher is not Launcher.NATIVE:
        engine_bin = runtimes.container_cli(config, runtime)
        post += ["--container", runtimes.container_name(runtime), "--container-cli", engine_bin]
    interval = int(runtime.restart_burst * (runtime.start_timeout_s + RESTART_SEC) + 60)
    env = {**cached, **runtime.env, **(sel.env if sel else {})}
    return _render(
        "runtime.service.j2",
        lay,
        rt=runtime,
        placed=placement.describe(cards) if cards else None,
        conflicts=[o.unit for o in others],
        after=after,
        system_scope=lay.scope is Scope.SYSTEM,
        environment=[render_environment(k, v) for k, v in sorted(env.items())],
        exec_start_pre=pre,
        exec_start=runtimes.exec_start(config, runtime, sel),
        exec_start_post=post,
        exec_stop=runtimes.exec_stop(config, runtime),
        exec_stop_post=runtimes.exec_stop_post(config, runtime),
        timeout_stop_s=runtimes.stop_timeouts(runtime).unit_s,
        start_limit_interval_s=interval,
        sandbox=sandbox.runtime(config, lay, runtime),
        cache_folder=runtimes.cache_folder(runtime),
        cache_env_file=lasting.ENV_FILE,
        wanted_by=lay.wanted_by,
    )


def proxy_program(config: Config) -> str:
    """b70-proxy (appliance.proxy.mount), installed beside b70ctl with LiteLLM."""
    return str(Path(config.b70ctl).parent / "b70-proxy")


def proxy_argv(config: Config, lay: Layout) -> list[str]:
    proxy = config.proxy
    argv = [proxy_program(config), "--config", str(lay.proxy_config)]
    # gunicorn takes its listening socket from systemd (LISTEN_FDS and LISTEN_PID, the
    # sd_listen_fds protocol), so --host and --port bind only when it is run by hand. The master
    # loads LiteLLM once and forks the workers, and starts a dead worker again.
    return [*argv, "--host", proxy.host, "--port", str(proxy.port), "--workers", str(proxy.workers)]


def listen_address(host: str, port: int) -> str:
    """The proxy's address as systemd's ListenStream= takes it (an IP address, not a name)."""
    if host.lower() in LOOPBACK_NAMES:
        host = "127.0.0.1"
    if ipaddress.ip_address(host).version == 6:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def render_proxy_socket(config: Config, lay: Layout) -> str:
    return _render(
        "litellm.socket.j2",
        lay,
        proxy=config.proxy,
        listen=listen_address(config.proxy.host, config.proxy.port),
        service=PROXY_UNIT,
    )


def proxy_environment(config: Config, lay: Layout) -> dict[str, str]:
    """The proxy's environment, the master key aside (that comes from the key file)."""
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else it fetches a price list at start-up
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",  # no per-request log lines: they cost CPU on every request
        "PYTHONUNBUFFERED": "1",
        # No reuse of connections to the runtime (0: a pooled connection is always too old).
        # Writing a request onto a keep-alive connection the runtime is closing fails it with
        # "Connection error"; a keep-alive shorter than the runtime's narrows that race but
        # leaves it open. A loopback connect per request costs nothing.
        "AIOHTTP_KEEPALIVE_TIMEOUT": "0",
        # For the request hold (appliance.proxy.hook): the switch's mark, the runtimes' addresses
        # (one per port, space-separated), the time.
        "B70_STATE_DIR": str(lay.state_dir),
        "B70_BACKEND_URL": " ".join(url for _, url in runtimes.deployments(config).values()),
        "B70_HOLD_S": f"{config.proxy.hold_s:g}",
        # For the request checks (appliance.proxy.door): the largest body taken, in bytes.
        "B70_MAX_BODY_BYTES": str(config.proxy.max_body_bytes),
    }
    tls = tls_files(config.proxy.tls, config.proxy.tls_cert, config.proxy.tls_key, lay.state_dir)
    if tls is not None:  # TLS beside plain HTTP on the port (appliance/proxy/share/tls.py)
        env["B70_TLS_CERT"], env["B70_TLS_KEY"] = str(tls.cert), str(tls.key)
    if config.peers.redis_host:  # the front doors share their keys there (proxy/share/fleet.py)
        host = config.peers.redis_host
        env["B70_REDIS"] = (
            f"[{host}]:{config.peers.redis_port}"
            if ":" in host
            else (f"{host}:{config.peers.redis_port}")
        )
        if config.peers.redis_tls:  # LiteLLM's names, which the door's client reads too
            env["REDIS_SSL"] = "True"
            if config.peers.redis_ca:
                env["REDIS_SSL_CA_CERTS"] = config.peers.redis_ca
    if config.peers.urls:  # other appliances' proxies: their readiness and the key they take
        env["B70_PEER_URL"] = " ".join(config.peers.urls)
    if config.peers.ca:  # what https:// peers are trusted by: the door's and LiteLLM's clients
        env["B70_PEER_CA"] = env["SSL_CERT_FILE"] = config.peers.ca
    if not config.proxy.pass_through:  # every model request LiteLLM's full way (relay.py)
        env["B70_PASS_THROUGH"] = "0"
    if config.proxy.fair:  # fair turns at a full runtime (appliance/proxy/share/fair.py)
        env["B70_SLOTS"] = runtimes.slots_text(config)
        env["B70_BATCH_WAIT_S"] = f"{config.proxy.batch_wait_s:g}"
        if config.proxy.keep_free:
            env["B70_KEEP_FREE"] = str(config.proxy.keep_free)
        if config.proxy.batch_share < 1:
            env["B70_BATCH_SHARE"] = f"{config.proxy.batch_share:g}"
    else:
        env["B70_FAIR"] = "0"
    return env


def render_proxy_unit(config: Config, lay: Layout) -> str:
    post = [config.b70ctl, "unit", "ready", "--url", runtimes.proxy_url(config)]
    post += ["--engine", "litellm", "--pid", MAINPID]
    return _render(
        "litellm.service.j2",
        lay,
        proxy=config.proxy,
        socket=PROXY_SOCKET,
        system_scope=lay.scope is Scope.SYSTEM,
        key_file=str(lay.key_file),
        environment=[render_environment(k, v) for k, v in proxy_environment(config, lay).items()],
        exec_start=proxy_argv(config, lay),
        exec_start_post=post,
        sandbox=sandbox.proxy(config, lay, proxy_program(config)),
        wanted_by=lay.wanted_by,
    )


def render_monitor_unit(config: Config, lay: Layout) -> str:
    argv = [config.b70ctl] + (["--user"] if lay.scope is Scope.USER else [])
    argv += ["--config", str(lay.config), "monitor"]
    return _render(
        "monitor.service.j2",
        lay,
        monitor=config.monitor,
        proxy_unit=PROXY_UNIT,
        exec_start=argv,
        sandbox=sandbox.monitor(config, lay),
        wanted_by=lay.wanted_by,
    )


def render_proxy_config(config: Config, lay: Layout) -> str:
    return _render(
        "litellm.yaml.j2",
        lay,
        proxy=config.proxy,
        deployments=[
            (name, url, runtimes.runtimes_by_port(config)[port])
            for port, (name, url) in runtimes.deployments(config).items()
        ],
        peers=runtimes.peer_deployments(config),
        peer_header=PEER_HEADER,
        cooldown_s=f"{config.peers.cooldown_s:g}",
        redis_host=config.peers.redis_host,
        redis_port=config.peers.redis_port,
    )


def render_all(
    config: Config, lay: Layout, devices: Sequence[Device] | None = None
) -> dict[str, str]:
    """Every file an installation consists of (the secret key aside), by file name. A config
    that names cards is placed on `devices`, by default this machine's GPUs."""
    placed = placement.placements(config, devices)
    files = {
        rt.unit: render_runtime_unit(config, rt, lay, placed[rt.name] if placed else None)
        for rt in config.runtimes.values()
    }
    files[PROXY_UNIT] = render_proxy_unit(config, lay)
    files[PROXY_SOCKET] = render_proxy_socket(config, lay)
    files[MONITOR_UNIT] = render_monitor_unit(config, lay)
    files[PROXY_CONFIG] = render_proxy_config(config, lay)
    if lay.scope is Scope.SYSTEM:  # the proxy has a user of its own
        files[SYSUSERS] = render_sysusers(run_as_users(config, lay))
    return dict(sorted(files.items()))


def cache_recipes(config: Config, devices: Sequence[Device] | None = None) -> dict[str, str]:
    """The recipe each runtime's units use in its cache folder, by that folder's name
    (appliance.engines.lasting): what install keeps there."""
    placed = placement.placements(config, devices)
    out = {}
    for rt in config.runtimes.values():
        sel = placement.selection(rt, placed[rt.name]) if placed else None
        out[runtimes.cache_folder(rt)] = runtimes.recipe(rt, sel)
    return out


def recipe_folder(
    config: Config, lay: Layout, runtime: RuntimeConfig, devices: Sequence[Device] | None = None
) -> Path:
    """The folder of `runtime`'s installed recipe in its lasting cache, on this machine (or
    placed on `devices`)."""
    name = runtimes.cache_folder(runtime)
    return lay.cache_root / name / cache_recipes(config, devices)[name]


def run_as_users(config: Config, lay: Layout) -> list[str]:
    """System users the runtimes run as (a user manager cannot change users)."""
    if lay.scope is not Scope.SYSTEM:
        return []
    return sorted({rt.user for rt in config.runtimes.values() if rt.user})


def render_sysusers(runtime_users: list[str]) -> str:
    """The proxy's user, and the users runtimes run as (in the render group)."""
    home = sandbox.SYSTEM_CACHE_ROOT / cache_name(PROXY_UNIT)  # its CacheDirectory=
    lines = ["# Rendered by b70ctl: the users the b70 units run as."]
    lines.append(f'u {sandbox.PROXY_USER} - "b70 appliance proxy" {home} -')
    for user in runtime_users:
        lines += [f'u {user} - "b70 appliance runtime" /var/lib/b70 -', f"m {user} render"]
    return "\n".join(lines) + "\n"
