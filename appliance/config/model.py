"""The appliance's configuration as frozen dataclasses: what config.reader makes of a file."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from appliance.apis import GENERATIVE
from appliance.config.hub import DEFAULT_DIR as DEFAULT_MODELS_DIR
from appliance.config.hub import HubModel
from appliance.errors import ConfigError
from appliance.layout import Scope, runtime_unit

SYSTEM_CONFIG = Path("/etc/b70/appliance.toml")


class Engine(StrEnum):
    VLLM = "vllm"
    LLAMACPP = "llamacpp"


class Launcher(StrEnum):
    NATIVE = "native"
    DOCKER = "docker"
    PODMAN = "podman"


# Flags the appliance sets itself from [proxy] and [backend]; a runtime's `args` may not set them.
RESERVED_FLAGS: dict[Engine, frozenset[str]] = {
    Engine.LLAMACPP: frozenset(
        {"--host", "--port", "--model", "-m", "--alias", "-a", "--mmproj", "--metrics"}
    ),
    Engine.VLLM: frozenset(
        {"--host", "--port", "--model", "--served-model-name", "--shutdown-timeout"}
    ),
}
DEFAULT_COMMAND: dict[Engine, tuple[str, ...]] = {
    Engine.LLAMACPP: ("llama-server",),
    Engine.VLLM: ("vllm", "serve"),
}
# Options of `docker run` / `podman run` that the appliance sets itself, or that a runtime's own
# key sets: a runtime's `container_options` may not set them (value: where it is set instead).
RESERVED_CONTAINER_OPTIONS: dict[str, str] = {
    "--name": "the appliance names the container b70-NAME",
    "--rm": "the appliance removes the container when it ends",
    "-d": "the unit runs the container in the foreground",
    "--detach": "the unit runs the container in the foreground",
    "--network": "runtimes share the host's network (on [backend] host and port)",
    "--net": "runtimes share the host's network (on [backend] host and port)",
    "--stop-timeout": "it comes from runtimes.NAME.stop_timeout_s",
    "--device": "use runtimes.NAME.devices",
    "-v": "use runtimes.NAME.volumes",
    "--volume": "use runtimes.NAME.volumes",
    "--shm-size": "use runtimes.NAME.shm_size",
    "-e": "use [runtimes.NAME.env]",
    "--env": "use [runtimes.NAME.env]",
}
# The environment through which a runtime on named cards is told them (appliance.host.placement).
PCI_ORDER_ENV = "ZE_ENABLE_PCI_ID_DEVICE_ORDER"
VLLM_MASK_ENV = "ZE_AFFINITY_MASK"
SYCL_SELECTOR_ENV = "ONEAPI_DEVICE_SELECTOR"
DEFAULT_START_TIMEOUT_S: dict[Engine, float] = {Engine.LLAMACPP: 300.0, Engine.VLLM: 900.0}


@dataclass(frozen=True)
class ProxyConfig:
    """[proxy]: the LiteLLM door on :8000, its workers, key and hold."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "b70"
    aliases: tuple[str, ...] = ()
    hold_s: float = 300.0  # how long a request waits at the proxy during a switch
    drain_s: float = 60.0  # how long a switch waits for the old runtime's requests to finish
    workers: int = 2  # the proxy's worker processes, each with its own event loop
    max_body_bytes: int = 8 * 1024**2  # a request body larger than this is refused (413)
    # Model requests take the fast way: straight to the runtime when the model has one
    # deployment (appliance/proxy/direct.py), else LiteLLM's vLLM pass-through route
    # (appliance/proxy/relay.py); false: LiteLLM's chat and completion routes, which do more
    # work per request and per chunk.
    pass_through: bool = True
    # When the runtime runs as many requests as it can, the rest wait at the door in one queue
    # per key, served in fair order (appliance/proxy/share/turns.py); false: they go to the
    # runtime as they come, which serves them first come, first served.
    fair: bool = True
    batch_wait_s: float = 30.0  # a batch key's request waiting this long goes before interactive
    # Places kept for a key with nothing running while another key fills the runtime: its first
    # token comes at once, and the key that fills the runtime runs that many fewer at once.
    keep_free: int = 0
    # The share of the places batch keys hold at most while an interactive key came within 30 s
    # (one at least, and all but one at most): below 1, what a person's request runs beside.
    batch_share: float = 1.0
    # TLS on the port (appliance/keys.py): the owner's certificate and key, or (both None) one
    # `b70ctl install` makes, self-signed. Plain HTTP still answers loopback.
    tls: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None


@dataclass(frozen=True)
class BackendConfig:
    """[backend]: where the runtimes listen by default."""

    host: str = "127.0.0.1"
    port: int = 8001


@dataclass(frozen=True)
class GpuConfig:
    """[gpu]: the device and cards, the memory a start needs free, how long to wait for it."""

    device: str = "auto"
    # The cards runtimes index (appliance.host.placement): "auto" (every B70, in PCI address order),
    # PCI addresses, or None when the config names no cards (one card, no device selection).
    cards: str | tuple[str, ...] | None = None
    memory_needed_bytes: int = 0
    release_timeout_s: float = 120.0


@dataclass(frozen=True)
class MonitorConfig:
    """[monitor]: how often it samples, when it restarts, where it serves."""

    host: str = "127.0.0.1"
    port: int = 9101
    interval_s: float = 5.0
    health_timeout_s: float = 5.0
    probe_completion: bool = True
    probe_timeout_s: float = 30.0
    hang_after: int = 3
    restart_tries: int = 2
    fallback: str | None = None


# [switching] order: the orders of switching on demand (appliance.switch.demand.policy)
ORDERS = ("policy", "collated", "fcfs")


@dataclass(frozen=True)
class SwitchingConfig:
    """[switching]: switch on demand, and the policy that decides when (docs/switch.md)."""

    # A request for a name whose runtime does not serve waits at the proxy, and the monitor
    # switches that runtime in when the policy says so (appliance.switch.demand).
    on_demand: bool = False
    # Which runtime serves next (appliance.switch.demand.policy): "policy", "collated" (first
    # come, first served as llama-swap serves now) or "fcfs" (strict first come, first served:
    # the requests behind one for another runtime wait)
    order: str = "policy"
    # "policy": a request that waited this long once it could be served goes first (None: only
    # when the proxy's hold would end before its swap did)
    max_wait_s: float | None = None
    stay_factor: float = 0.0  # "policy": a runtime serves this many times its swap's cost (0: off)
    batch: int = 0  # "policy": this many waiting for another swap a busy runtime out (0: off)
    idle_return_s: float | None = None  # back to default_runtime after this long with no request
    backoff_s: float = 60.0  # a runtime that failed to start on demand is not tried for this long

    @property
    def fcfs(self) -> bool:
        """Strict first come, first served: the proxy keeps a newer request behind an older one."""
        return self.order == "fcfs"


@dataclass(frozen=True)
class PeersConfig:
    """Other b70 appliances whose proxies serve the same names: this proxy routes to them too."""

    urls: tuple[str, ...] = ()  # http(s)://HOST:PORT of each peer's proxy
    # The certificates that https:// peers are trusted by (PEM, one file; e.g. their self-signed
    # ones, concatenated); None: the system's trust.
    ca: str | None = None
    # Where two front doors share their routing data (cooldowns, usage): LiteLLM's Redis
    redis_host: str | None = None
    redis_port: int = 6379
    redis_tls: bool = False  # Redis speaks TLS (rediss://); its password is REDIS_PASSWORD
    redis_ca: str | None = None  # what its certificate is trusted by (PEM); None: the system's
    cooldown_s: float = 5.0  # how long a peer that failed is left out


@dataclass(frozen=True)
class RuntimeConfig:
    """One [runtimes.NAME]: its engine, how it is launched, its model, cards and port."""

    name: str
    engine: Engine
    launcher: Launcher
    model: str
    command: tuple[str, ...] = ()
    image: str | None = None
    mmproj: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    # The APIs it serves, by appliance.apis' words (runtimes.NAME.apis, or read from its flags)
    apis: tuple[str, ...] = GENERATIVE
    devices: tuple[str, ...] = ()
    volumes: tuple[str, ...] = ()
    shm_size: str | None = None
    # More options of `docker run` / `podman run`, after the appliance's own, before the image
    container_options: tuple[str, ...] = ()
    user: str | None = None  # system scope: run as this user, with the render group and CAP_PERFMON
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    restart_burst: int = 3
    # Its lasting compile cache (appliance.engines.lasting): at most this much; 0 keeps nothing
    cache_max_bytes: int = 16 * 1024**3
    memory_needed_bytes: int = 0  # on each of its cards
    cards: tuple[int, ...] | None = None  # indices into [gpu] cards; None: the first card
    port: int = 8001  # where it listens on [backend] host; default [backend] port
    served_model_name: str = "b70"  # the name clients ask for on the proxy; default [proxy] model
    # A replica of `per_card = true` runtime: the name of that runtime (its replica set)
    group: str | None = None
    hub: HubModel | None = None  # model = "hf:...": where it is pulled from (model: where to)

    @property
    def unit(self) -> str:
        return runtime_unit(self.name)

    @property
    def card_indices(self) -> tuple[int, ...]:
        """Its cards by index into [gpu] cards; a runtime that names none is on the first."""
        return self.cards if self.cards is not None else (0,)


@dataclass(frozen=True)
class Config:
    """The whole appliance.toml, checked."""

    path: Path
    default_runtime: str
    proxy: ProxyConfig
    backend: BackendConfig
    gpu: GpuConfig
    runtimes: Mapping[str, RuntimeConfig]
    b70ctl: str
    monitor: MonitorConfig = MonitorConfig()
    docker: str = "/usr/bin/docker"
    podman: str = "/usr/bin/podman"
    peers: PeersConfig = PeersConfig()
    switching: SwitchingConfig = SwitchingConfig()
    models_dir: str = DEFAULT_MODELS_DIR  # [models] dir: where `b70ctl models pull` puts them
    # The file's text as it was validated: install keeps exactly this, not a later copy.
    text: str = field(default="", repr=False, compare=False)

    def runtime(self, name: str) -> RuntimeConfig:
        try:
            return self.runtimes[name]
        except KeyError:
            known = ", ".join(sorted([*self.runtimes, *self.groups]))
            raise ConfigError(
                f"{self.path}: there is no runtime named {name!r}",
                hint=f"configured runtimes: {known}",
            ) from None

    @property
    def groups(self) -> dict[str, tuple[str, ...]]:
        """Runtimes with one replica per card (`per_card = true`): name -> its replicas, in the
        order of its cards."""
        out: dict[str, list[str]] = {}
        for name, rt in self.runtimes.items():
            if rt.group is not None:
                out.setdefault(rt.group, []).append(name)
        return {group: tuple(names) for group, names in sorted(out.items())}

    def members(self, name: str) -> tuple[str, ...]:
        """The runtimes a name stands for: a replica set's replicas, or the runtime itself."""
        groups = self.groups
        if name in groups:
            return groups[name]
        return (self.runtime(name).name,)


def default_config_path(scope: Scope) -> Path:
    env = os.environ.get("B70_CONFIG")
    if env:
        return Path(env)
    if scope is Scope.USER:
        base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        return Path(base) / "b70" / "appliance.toml"
    return SYSTEM_CONFIG


def default_b70ctl() -> str:
    import sys

    return str(Path(sys.executable).parent / "b70ctl")
