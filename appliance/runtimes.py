"""Engines and launchers: the command line of each runtime, and where to ask it about health."""

from __future__ import annotations

from appliance.config import Config, Engine, Launcher, RuntimeConfig

HEALTH_PATH = "/health"  # both engines: 200 only once the model is loaded
METRICS_PATH = "/metrics"


def engine_argv(config: Config, runtime: RuntimeConfig) -> list[str]:
    """The engine's own arguments: model, address, served name, then the user's args."""
    host, port = config.backend.host, str(config.backend.port)
    if runtime.engine is Engine.LLAMACPP:
        argv = ["--model", runtime.model, "--host", host, "--port", port]
        argv += ["--alias", config.proxy.model, "--metrics"]
        if runtime.mmproj:
            argv += ["--mmproj", runtime.mmproj]
    else:
        argv = ["--model", runtime.model, "--served-model-name", config.proxy.model]
        argv += ["--host", host, "--port", port]
    return argv + list(runtime.args)


def container_cli(config: Config, runtime: RuntimeConfig) -> str:
    """The docker or podman executable of a container runtime."""
    return config.docker if runtime.launcher is Launcher.DOCKER else config.podman


def container_name(runtime: RuntimeConfig) -> str:
    return f"b70-{runtime.name}"


def exec_start(config: Config, runtime: RuntimeConfig) -> list[str]:
    """The full ExecStart= argv of a runtime unit."""
    if runtime.launcher is Launcher.NATIVE:
        return list(runtime.command) + engine_argv(config, runtime)
    engine_bin = container_cli(config, runtime)
    argv = [engine_bin, "run", "--rm", "--name", container_name(runtime), "--network", "host"]
    argv += ["--stop-timeout", str(int(runtime.stop_timeout_s))]
    for device in runtime.devices:
        argv += ["--device", device]
    if runtime.shm_size:
        argv += ["--shm-size", runtime.shm_size]
    for volume in runtime.volumes:
        argv += ["--volume", volume]
    for key in sorted(runtime.env):
        argv += ["--env", key]  # the value comes from the unit's Environment=
    argv.append(runtime.image or "")
    return argv + engine_argv(config, runtime)


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
    timeout = str(int(runtime.stop_timeout_s))
    return [[engine_bin, "stop", "--time", timeout, container_name(runtime)]]


def backend_url(config: Config) -> str:
    host = config.backend.host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.backend.port}"


def proxy_url(config: Config) -> str:
    host = config.proxy.host
    if host in {"0.0.0.0", "::"}:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.proxy.port}"
