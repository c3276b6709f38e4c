"""Reading a config file: TOML in, a checked Config out. Every error names the file, the
dotted key (and list index) and what is wrong; reading never writes anything."""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from appliance import GIB, MIB, apis
from appliance.config import hub
from appliance.config.cards import CardKeys
from appliance.config.model import (
    DEFAULT_COMMAND,
    DEFAULT_START_TIMEOUT_S,
    RESERVED_CONTAINER_OPTIONS,
    RESERVED_FLAGS,
    BackendConfig,
    Config,
    Engine,
    GpuConfig,
    Launcher,
    MonitorConfig,
    ProxyConfig,
    RuntimeConfig,
    default_b70ctl,
)
from appliance.config.serving import ServingKeys
from appliance.config.values import (
    DAY_S,
    HOUR_S,
    MAX_CACHE_GIB,
    MAX_MEMORY_GIB,
    NAME_RE,
    RESERVED_NAMES,
    check_executable,
    check_host,
    check_image,
    check_listen_host,
    check_model_name,
    check_pci_address,
    check_port,
    check_range,
    check_size,
    check_user_name,
    check_word,
    hosts_overlap,
    is_loopback,
    refuse_control_characters,
)
from appliance.config.walk import kind_of
from appliance.errors import ConfigError


def load(path: Path) -> Config:
    """Read and validate one configuration file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such configuration file",
            hint="copy examples/demo.toml or examples/b70.toml there, or pass --config",
        ) from None
    except OSError as e:
        raise ConfigError(
            f"{path}: cannot read it: {e.strerror}", hint="check the path and its permissions"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{path}: not UTF-8: byte {e.start} (line {line}) is {data[e.start]:#04x}",
            hint="save the file as UTF-8",
        ) from None
    return parse(text, path)


def parse(text: str, path: Path) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            f"{path}: not valid TOML: {e}", hint="fix the syntax at that line"
        ) from None
    refuse_control_characters(path, data)
    return dataclasses.replace(_Reader(path).config(data), text=text)


RUNTIME_KEYS = {
    *("engine", "launcher", "model", "command", "image", "mmproj", "env", "args"),
    *("devices", "volumes", "shm_size", "container_options", "user"),
    *("start_timeout_s", "stop_timeout_s", "restart_burst", "memory_needed_gib", "cards"),
    *("port", "served_model_name", "per_card", "apis", "cache_max_gib"),
}


class _Reader(CardKeys, ServingKeys):
    """The appliance's sections of the config file."""

    def config(self, data: Mapping[str, Any]) -> Config:
        top = {
            "default_runtime",
            "b70ctl",
            "docker",
            "podman",
            "proxy",
            "backend",
            "gpu",
            "runtimes",
            "monitor",
            "peers",
            "switching",
            "models",
        }
        self.known(data, "", top)
        models = self.table(data, "models")
        self.known(models, "models.", {"dir"})
        self.models_dir = self.path_value(models, "dir", "models.", hub.DEFAULT_DIR)
        proxy = self.proxy(self.table(data, "proxy"))
        backend = self.backend(self.table(data, "backend"))
        gpu = self.gpu(self.table(data, "gpu"))
        runtimes_table = self.table(data, "runtimes")
        if not runtimes_table:
            raise self.fail("runtimes", "no runtime is configured", "add a [runtimes.NAME] table")
        runtimes = {
            name: self.runtime(name, self.table(runtimes_table, name, "runtimes."), gpu)
            for name in runtimes_table
        }
        runtimes = {
            name: self.served(rt, self.table(runtimes_table, name, "runtimes."), proxy, backend)
            for name, rt in runtimes.items()
        }
        runtimes = self.replicas(runtimes, runtimes_table)
        groups = {rt.group for rt in runtimes.values() if rt.group}
        default = self.get(data, "default_runtime", "", str)
        if default not in runtimes and default not in groups:
            raise self.fail(
                "default_runtime",
                f"{default!r} is not a configured runtime",
                "one of: " + ", ".join(sorted({*runtimes, *groups})),
            )
        monitor = self.monitor(self.table(data, "monitor"), set(runtimes))
        if not is_loopback(monitor.host) and not proxy.tls:
            raise self.fail(
                "monitor.host", f"{monitor.host} is beyond loopback, where the status page takes "
                "the appliance key, and only over TLS", hint="set tls = true in [proxy] (the page "
                'is served with its certificate), or host = "127.0.0.1" in [monitor]',
            )  # fmt: skip
        self.listeners({"proxy": proxy, "backend": backend, "monitor": monitor})
        self.runtime_ports(runtimes, backend.host, {"proxy": proxy, "monitor": monitor})
        self.side_by_side(runtimes)
        return Config(
            peers=self.peers(self.table(data, "peers"), proxy),
            switching=self.switching(self.table(data, "switching"), proxy, runtimes),
            monitor=monitor,
            path=self.path,
            default_runtime=default,
            proxy=proxy,
            backend=backend,
            gpu=gpu,
            runtimes=runtimes,
            b70ctl=self.path_value(data, "b70ctl", "", default_b70ctl()),
            docker=self.path_value(data, "docker", "", "/usr/bin/docker"),
            podman=self.path_value(data, "podman", "", "/usr/bin/podman"),
            models_dir=self.models_dir,
        )

    def listeners(
        self, sections: Mapping[str, ProxyConfig | BackendConfig | MonitorConfig]
    ) -> None:
        """No two listeners on one port where their addresses overlap."""
        seen: list[tuple[str, str, int]] = []
        for name, section in sections.items():
            for other, host, port in seen:
                if port == section.port and hosts_overlap(host, section.host):
                    raise self.fail(
                        f"{name}.port",
                        f"{port} is also {other}.port, and {section.host!r} overlaps {host!r}",
                        "give each listener its own port",
                    )
            seen.append((name, section.host, section.port))

    def proxy(self, t: Mapping[str, Any]) -> ProxyConfig:
        p = "proxy."
        allowed = {
            "host",
            "port",
            "model",
            "aliases",
            "hold_s",
            "drain_s",
            "workers",
            "litellm",
            "max_body_mib",
            "pass_through",
            "fair",
            "batch_wait_s",
            "keep_free",
            "batch_share",
            "tls",
            "tls_cert",
            "tls_key",
        }
        self.known(t, p, allowed)
        model = self.get(t, "model", p, str, "b70", check_model_name)
        aliases = self.strings(t, "aliases", p)
        for alias in aliases:
            if (problem := check_model_name(alias)) or alias == model:
                raise self.fail(p + "aliases", f"{alias!r}: {problem or 'repeats proxy.model'}")
        if "litellm" in t:
            raise self.fail(
                p + "litellm", "is no longer read: the proxy runs as b70-proxy, installed beside "
                "b70ctl with LiteLLM", hint="remove this line",
            )  # fmt: skip
        tls, cert, key = self.tls(t, p)
        fair = self.get(t, "fair", p, bool, True)
        for shaping in ("batch_wait_s", "keep_free", "batch_share"):
            if not fair and shaping in t:
                raise self.fail(
                    p + shaping, "does nothing with fair = false: it shapes the fair turns",
                    hint=f"set fair = true, or remove {shaping}",
                )  # fmt: skip
        return ProxyConfig(
            tls=tls,
            tls_cert=cert,
            tls_key=key,
            host=self.get(t, "host", p, str, "127.0.0.1", check_listen_host),
            port=self.get(t, "port", p, int, 8000, check_port),
            model=model,
            aliases=aliases,
            hold_s=self.get(t, "hold_s", p, float, 300.0, check_range(0, HOUR_S, low_open=True)),
            drain_s=self.get(t, "drain_s", p, float, 60.0, check_range(0, HOUR_S)),
            workers=self.get(t, "workers", p, int, 2, lambda v: None if 1 <= v <= 64 else "1-64"),
            # 8 MiB holds a whole 131072-token context as text several times over, and a few
            # images as data URLs.
            pass_through=self.get(t, "pass_through", p, bool, True),
            fair=fair,
            batch_wait_s=self.get(t, "batch_wait_s", p, float, 30.0, check_range(0, HOUR_S)),
            keep_free=self.get(t, "keep_free", p, int, 0, check_range(0, 1024)),
            batch_share=self.get(t, "batch_share", p, float, 1.0, check_range(0, 1, low_open=True)),
            max_body_bytes=int(
                self.get(t, "max_body_mib", p, float, 8.0, check_range(0, 1024, low_open=True))
                * MIB
            ),
        )

    def tls(self, t: Mapping[str, Any], p: str) -> tuple[bool, str | None, str | None]:
        """`tls`, and the owner's certificate and key: both or neither, and only with TLS on."""
        tls = self.get(t, "tls", p, bool, False)
        given = [k for k in ("tls_cert", "tls_key") if k in t]
        if given and not tls:
            raise self.fail(
                p + given[0], "is set but tls is false",
                hint="set tls = true to serve it, or remove tls_cert and tls_key",
            )  # fmt: skip
        if len(given) == 1:
            other = "tls_key" if given[0] == "tls_cert" else "tls_cert"
            raise self.fail(
                p + given[0], f"is set without {other}",
                hint="give both (the certificate and its private key), or neither for a "
                "self-signed certificate made at install",
            )  # fmt: skip
        paths = [self.path_value(t, k, p, "/") for k in given]
        for k, path in zip(given, paths, strict=True):
            if not path.isprintable():
                raise self.fail(p + k, f"{path!r} holds a character that is not printable")
        cert, key = paths if paths else (None, None)
        return tls, cert, key

    def backend(self, t: Mapping[str, Any]) -> BackendConfig:
        p = "backend."
        self.known(t, p, {"host", "port"})
        host = self.get(t, "host", p, str, "127.0.0.1", check_host)
        if not is_loopback(host):
            raise self.fail(
                p + "host",
                f"{host!r} is not a loopback address",
                "runtimes answer without a key: only the proxy faces the network; "
                "use 127.0.0.1, ::1 or localhost",
            )
        return BackendConfig(host=host, port=self.get(t, "port", p, int, 8001, check_port))

    def gpu(self, t: Mapping[str, Any]) -> GpuConfig:
        p = "gpu."
        self.known(t, p, {"device", "cards", "memory_needed_gib", "release_timeout_s"})
        needed = self.get(t, "memory_needed_gib", p, float, 0.0, check_range(0, MAX_MEMORY_GIB))
        if "device" in t and "cards" in t:
            raise self.fail(
                p + "cards",
                "gpu.device names one card, gpu.cards all of them: use one",
                'e.g. cards = ["0000:03:00.0", "0000:04:00.0"], or cards = "auto"',
            )
        return GpuConfig(
            cards=self.gpu_cards(t, p),
            device=self.get(t, "device", p, str, "auto", check_pci_address),
            memory_needed_bytes=int(needed * GIB),
            release_timeout_s=self.get(
                t, "release_timeout_s", p, float, 120.0, check_range(0, HOUR_S, low_open=True)
            ),
        )

    def runtime_name(self, name: str) -> None:
        if not NAME_RE.fullmatch(name):
            raise self.fail(
                f"runtimes.{name}",
                "a runtime name is 1-32 of a-z, 0-9 and single '-' between them, "
                "starting with a letter",
                "e.g. vllm-tp4",
            )
        if name in RESERVED_NAMES:
            raise self.fail(
                f"runtimes.{name}",
                f"{name!r} is a name the appliance uses for its own units",
                "reserved: " + ", ".join(sorted(RESERVED_NAMES)),
            )

    def runtime(self, name: str, t: Mapping[str, Any], gpu: GpuConfig) -> RuntimeConfig:
        p = f"runtimes.{name}."
        self.runtime_name(name)
        self.known(t, p, RUNTIME_KEYS)
        engine = self.choice(t, "engine", p, Engine, None)
        launcher = self.choice(t, "launcher", p, Launcher, Launcher.NATIVE)
        args = self.runtime_args(t, p, engine)
        served_apis = self.runtime_apis(t, p, engine, args)
        env_table = self.runtime_env(t, p)
        command, image = self.command_or_image(t, p, engine, launcher)
        mmproj = self.get(t, "mmproj", p, str, "", check_word) or None
        if mmproj and engine is not Engine.LLAMACPP:
            raise self.fail(p + "mmproj", "only the llamacpp engine takes a vision projector")
        if command and (problem := check_executable(command[0])):
            raise self.fail(p + "command[0]", problem)
        model = os.path.expanduser(self.get(t, "model", p, str, None, check_word))
        source = self.hub_model(model, p) if model.startswith(hub.PREFIX) else None
        volumes = self.paths(t, "volumes", p, "/srv/models:/models:ro")
        if mmproj and mmproj.startswith(hub.PREFIX):
            found = hub.with_projector(source, mmproj, self.models_dir)
            if isinstance(found, str):
                raise self.fail(p + "mmproj", found, hub.PROJECTOR_HINT)
            source, mmproj = found
        if source is not None:
            model = str(source.local_path(self.models_dir))
            if launcher is not Launcher.NATIVE:  # the same path inside the container, read-only
                folder = source.folder(self.models_dir)
                volumes = (*volumes, f"{folder}:{folder}:ro")
        start_default = DEFAULT_START_TIMEOUT_S[engine]
        needed_gib = self.get(
            t, "memory_needed_gib", p, float, -1.0, check_range(0, MAX_MEMORY_GIB)
        )
        devices = self.paths(t, "devices", p, "/dev/dri or /dev/dri/renderD128:/dev/dri/renderD128")
        cache_gib = self.get(t, "cache_max_gib", p, float, 16.0, check_range(0, MAX_CACHE_GIB))
        return RuntimeConfig(
            name=name,
            engine=engine,
            launcher=launcher,
            model=model,
            command=command,
            image=image,
            mmproj=os.path.expanduser(mmproj) if mmproj else None,
            env=dict(env_table),
            args=args,
            apis=served_apis,
            devices=devices,
            cards=self.runtime_cards(t, p, gpu, engine, launcher, args, devices, env_table),
            volumes=volumes,
            hub=source,
            shm_size=self.get(t, "shm_size", p, str, "", check_size) or None,
            container_options=self.container_options(t, p, launcher),
            user=self.get(t, "user", p, str, "", check_user_name) or None,
            start_timeout_s=self.get(
                t, "start_timeout_s", p, float, start_default, check_range(1, DAY_S)
            ),
            stop_timeout_s=self.get(t, "stop_timeout_s", p, float, 30.0, check_range(1, HOUR_S)),
            restart_burst=self.get(t, "restart_burst", p, int, 3, check_range(1, 100)),
            cache_max_bytes=int(cache_gib * GIB),
            # [gpu] memory_needed_gib is the default for every runtime
            memory_needed_bytes=(
                int(needed_gib * GIB) if needed_gib >= 0 else gpu.memory_needed_bytes
            ),
        )

    def hub_model(self, value: str, p: str) -> hub.HubModel:
        found = hub.parse(value)
        if isinstance(found, str):
            raise self.fail(p + "model", found)
        return found

    def runtime_args(self, t: Mapping[str, Any], p: str, engine: Engine) -> tuple[str, ...]:
        args = self.strings(t, "args", p)
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag in RESERVED_FLAGS[engine]:
                raise self.fail(
                    p + "args",
                    f"sets {flag}, which the appliance sets itself",
                    "the port and host come from [backend] (or runtimes.NAME.port), the "
                    "model name from [proxy] (or runtimes.NAME.served_model_name), the model "
                    "from runtimes.NAME.model",
                )
        return args

    def runtime_apis(
        self, t: Mapping[str, Any], p: str, engine: Engine, args: tuple[str, ...]
    ) -> tuple[str, ...]:
        """The APIs the runtime serves: as given, else what its engine and flags say."""
        if "apis" not in t:
            return apis.served(engine.value, args)
        given = self.strings(t, "apis", p)
        words = ", ".join(apis.ALL)
        if not given:
            raise self.fail(p + "apis", "must name at least one API", f"the APIs: {words}")
        for i, api in enumerate(given):
            if api not in apis.ALL:
                raise self.fail(f"{p}apis[{i}]", f"{api!r} is not an API the door opens",
                                f"the APIs: {words}")  # fmt: skip
            if api in given[:i]:
                raise self.fail(f"{p}apis[{i}]", f"{api!r} is named twice")
        return tuple(a for a in apis.ALL if a in given)

    def container_options(
        self, t: Mapping[str, Any], p: str, launcher: Launcher
    ) -> tuple[str, ...]:
        """More `docker run` / `podman run` options, such as `--runtime runc` or `--ulimit
        nofile=1024:1024`: words of the command line before the image. Each is an option or the
        value right after one (else it would be read as the image); none may set what the
        appliance sets, or what a key of the runtime sets."""
        key = p + "container_options"
        options = self.strings(t, "container_options", p)
        if options and launcher is Launcher.NATIVE:
            raise self.fail(key, "only container launchers take container options")
        for i, option in enumerate(options):
            if not option.strip():
                raise self.fail(f"{key}[{i}]", "must not be empty")
            if not option.startswith("-"):
                before = options[i - 1] if i else ""
                if before.startswith("-") and "=" not in before:
                    continue  # the value of the option before it
                raise self.fail(
                    f"{key}[{i}]",
                    f"{option!r} is neither an option nor the value of one: the {launcher} "
                    "command would read it as the image",
                    'e.g. container_options = ["--ulimit", "nofile=1024:1024"]',
                )
            flag = option.split("=", 1)[0] if option.startswith("--") else option[:2]
            if flag in RESERVED_CONTAINER_OPTIONS:
                raise self.fail(
                    f"{key}[{i}]", f"may not set {flag}: {RESERVED_CONTAINER_OPTIONS[flag]}"
                )
        return options

    def runtime_env(self, t: Mapping[str, Any], p: str) -> Mapping[str, Any]:
        env_table = self.table(t, "env", p)
        for key, value in env_table.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise self.fail(p + "env." + key, "not a valid environment variable name")
            if not isinstance(value, str):
                raise self.fail(p + "env." + key, f"must be a string, not {kind_of(value)}")
        return env_table

    def command_or_image(
        self, t: Mapping[str, Any], p: str, engine: Engine, launcher: Launcher
    ) -> tuple[tuple[str, ...], str | None]:
        """A native runtime's command (the engine's own by default), or a container's image."""
        command = tuple(os.path.expanduser(c) for c in self.strings(t, "command", p))
        image = self.get(t, "image", p, str, "", check_image) or None
        if launcher is Launcher.NATIVE:
            if image:
                raise self.fail(p + "image", "only container launchers use an image")
            return command or DEFAULT_COMMAND[engine], None
        if not image:
            raise self.fail(p + "image", f"missing: the {launcher} launcher runs an image")
        if command:
            raise self.fail(p + "command", "container launchers run the image's entrypoint")
        return command, image
