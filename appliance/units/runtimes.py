"""Engines and launchers: the command line of each runtime, its container, and its stop times."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance import engines, layout
from appliance.config import Config, Engine, Launcher, RuntimeConfig
from appliance.engines import lasting

if TYPE_CHECKING:
    from appliance.host.placement import Selection


class Verbatim(str):
    """A word that systemd must expand itself, such as ${MAINPID} or a path under %C."""


@dataclass(frozen=True)
class StopTimeouts:
    """How long a stop may take, innermost first; each layer waits longer than the one inside.

    engine_s: in-flight requests may finish (vLLM's --shutdown-timeout; SIGTERM's grace).
    container_s: `docker stop --time` / `--stop-timeout`, then the engine is killed.
    unit_s: systemd's TimeoutStopSec=, then systemd kills what is left.
    """

    engine_s: int
    container_s: int | None
    unit_s: int


def stop_timeouts(runtime: RuntimeConfig) -> StopTimeouts:
    engine = math.ceil(runtime.stop_timeout_s)
    container = None if runtime.launcher is Launcher.NATIVE else engine + 10
    return StopTimeouts(engine, container, (container or engine) + 15)


def engine_argv(config: Config, runtime: RuntimeConfig, sel: Selection | None = None) -> list[str]:
    """The engine's own arguments: model, address, served name, the cards' (tensor parallel),
    then the user's args."""
    host, port, name = config.backend.host, str(runtime.port), runtime.served_model_name
    if runtime.engine is Engine.LLAMACPP:
        argv = ["--model", runtime.model, "--host", host, "--port", port]
        argv += ["--alias", name, "--metrics"]
        if runtime.mmproj:
            argv += ["--mmproj", runtime.mmproj]
    else:
        argv = ["--model", runtime.model, "--served-model-name", name]
        argv += ["--host", host, "--port", port]
        argv += ["--shutdown-timeout", str(stop_timeouts(runtime).engine_s)]
    return argv + list(sel.args if sel else ()) + list(runtime.args)


def container_cli(config: Config, runtime: RuntimeConfig) -> str:
    """The docker or podman executable of a container runtime."""
    return config.docker if runtime.launcher is Launcher.DOCKER else config.podman


def container_name(runtime: RuntimeConfig) -> str:
    return layout.container_name(runtime.name)


# --- its lasting cache (appliance.engines.lasting) ------------------------------------------------


def cache_folder(runtime: RuntimeConfig) -> str:
    """The runtime's cache folder, its CacheDirectory= and RuntimeDirectory= name: b70-NAME."""
    return layout.cache_name(runtime.unit)


def recipe(runtime: RuntimeConfig, sel: Selection | None = None) -> str:
    """The name of its recipe's folder in its cache folder."""
    return lasting.fingerprint(runtime, sel.args if sel else (), sel.env if sel else {})


def recipe_on_host(runtime: RuntimeConfig, sel: Selection | None = None) -> Verbatim:
    """Its recipe's folder on the host, as the unit names it (%C: /var/cache or ~/.cache)."""
    return Verbatim(f"%C/{cache_folder(runtime)}/{recipe(runtime, sel)}")


def cache_env(runtime: RuntimeConfig, sel: Selection | None = None) -> dict[str, str]:
    """The engine's cache variables, pointing into its recipe's folder as the engine sees it
    (in a container: under the mount); those the config sets itself are left to it."""
    taken = {*runtime.env, *(sel.env if sel else {})}
    if runtime.launcher is Launcher.NATIVE:
        where: str = recipe_on_host(runtime, sel)
    else:
        where = f"{lasting.CONTAINER_ROOT}/{recipe(runtime, sel)}"
    env = lasting.engine_env(engines.of(runtime.engine), where, taken)
    if isinstance(where, Verbatim):
        return {k: Verbatim(v) if v.startswith(where) else v for k, v in env.items()}
    return env


def cache_switches(runtime: RuntimeConfig) -> list[str]:
    """What a start that keeps nothing sets besides (the guard's environment file), which a
    container must be told to take from the unit."""
    return sorted(engines.of(runtime.engine).cold_env)


def exec_start(config: Config, runtime: RuntimeConfig, sel: Selection | None = None) -> list[str]:
    """The full ExecStart= argv of a runtime unit; `sel`: its cards, when the config names them
    (appliance.host.placement)."""
    if runtime.launcher is Launcher.NATIVE:
        return list(runtime.command) + engine_argv(config, runtime, sel)
    engine_bin = container_cli(config, runtime)
    argv = [engine_bin, "run", "--rm", "--name", container_name(runtime), "--network", "host"]
    argv += ["--stop-timeout", str(stop_timeouts(runtime).container_s)]
    for device in (*runtime.devices, *(sel.devices if sel else ())):
        argv += ["--device", device]
    if runtime.shm_size:
        argv += ["--shm-size", runtime.shm_size]
    for volume in (*runtime.volumes, *(sel.volumes if sel else ())):
        argv += ["--volume", volume]
    # Its lasting cache: the runtime's whole cache folder, which systemd makes before a start
    argv += ["--volume", Verbatim(f"%C/{cache_folder(runtime)}:{lasting.CONTAINER_ROOT}")]
    keys = {*runtime.env, *(sel.env if sel else ()), *cache_env(runtime, sel)}
    for key in sorted(keys | set(cache_switches(runtime))):
        argv += ["--env", key]  # the value comes from the unit's Environment=
    argv += runtime.container_options
    argv.append(runtime.image or "")
    return argv + engine_argv(config, runtime, sel)


def exec_stop_post(config: Config, runtime: RuntimeConfig) -> list[list[str]]:
    """Cleanup that runs after every stop, failed starts included."""
    if runtime.launcher is Launcher.NATIVE:
        return []
    engine_bin = container_cli(config, runtime)
    # A killed client leaves the container running with its VRAM: remove it by name.
    return [[engine_bin, "rm", "--force", container_name(runtime)]]


def exec_stop(config: Config, runtime: RuntimeConfig) -> list[list[str]]:
    if runtime.launcher is Launcher.NATIVE:
        return []
    engine_bin = container_cli(config, runtime)
    timeout = str(stop_timeouts(runtime).container_s)
    return [[engine_bin, "stop", "--time", timeout, container_name(runtime)]]


def backend_url(config: Config, runtime: RuntimeConfig | None = None) -> str:
    """Where `runtime` listens; without one, [backend] port (the runtimes' port by default)."""
    host = config.backend.host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{runtime.port if runtime else config.backend.port}"


def deployments(config: Config) -> dict[int, tuple[str, str]]:
    """The proxy's deployments, one per runtime port: port -> (served name, URL). Runtimes that
    share a port take turns on it under one name (appliance.config.cards.side_by_side)."""
    out: dict[int, tuple[str, str]] = {}
    for _, rt in sorted(config.runtimes.items()):
        out.setdefault(rt.port, (rt.served_model_name, backend_url(config, rt)))
    return dict(sorted(out.items()))


def runtimes_by_port(config: Config) -> dict[int, dict[str, dict[str, Any]]]:
    """The runtimes of each deployment, by its port, with the engine and the APIs of each
    (appliance.apis): rendered into the deployment's model_info, for the door's /v1/models."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for name, rt in sorted(config.runtimes.items()):
        out.setdefault(rt.port, {})[name] = {"engine": rt.engine.value, "apis": list(rt.apis)}
    return out


def peer_deployments(config: Config) -> list[tuple[str, str]]:
    """Each name this box serves, at each peer's proxy: (name, URL)."""
    names = sorted({rt.served_model_name for rt in config.runtimes.values()})
    return [(name, url.rstrip("/")) for name in names for url in config.peers.urls]


def proxy_url(config: Config) -> str:
    host = config.proxy.host
    if host in {"0.0.0.0", "::"}:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.proxy.port}"


# vLLM's default of requests at once for its OpenAI server on a card under 70 GiB (vLLM 0.32,
# EngineArgs.get_batch_defaults; its CPU build takes 128 per CPU rank).
VLLM_MAX_NUM_SEQS = 256
SLOT_FLAGS = {Engine.VLLM: ("--max-num-seqs",), Engine.LLAMACPP: ("--parallel", "-np")}
ENGINE_WORDS = {Engine.VLLM: "vLLM", Engine.LLAMACPP: "llama.cpp"}  # as the door names them


def slots_of(runtime: RuntimeConfig) -> int | None:
    """Requests the runtime runs at once, as its arguments say (vLLM's default when they do not);
    None for llama.cpp without `--parallel` (or auto), whose /props says it."""
    args = list(runtime.args)
    found: str | None = None
    for i, arg in enumerate(args):
        for flag in SLOT_FLAGS[runtime.engine]:
            if arg == flag and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(flag + "="):
                found = arg.split("=", 1)[1]
    if found is not None and found.isdigit() and int(found) > 0:
        return int(found)
    return VLLM_MAX_NUM_SEQS if runtime.engine is Engine.VLLM else None


def slots_text(config: Config) -> str:
    """B70_SLOTS for the proxy's fair turns: "PORT/ENGINE=N ...", the fewest where runtimes of
    one engine share a port (appliance/proxy/share/fair.py)."""
    out: dict[str, int] = {}
    for _, rt in sorted(config.runtimes.items()):
        n = slots_of(rt)
        if n is not None:
            key = f"{rt.port}/{ENGINE_WORDS[rt.engine]}"
            out[key] = min(n, out.get(key, n))
    return " ".join(f"{k}={v}" for k, v in sorted(out.items()))
