"""The demo appliance for a benchmark: installed under a private user manager, on free ports,
with its own config and state homes; uninstalled and the manager stopped afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from b70tools.net import free_port

REPO = Path(__file__).resolve().parent.parent
B70CTL = str(Path(sys.executable).parent / "b70ctl")
USER_MANAGER = str(REPO / "scripts" / "user-manager")


def demo_text(
    proxy_port: int,
    backend_port: int,
    cache: str,
    extra: str = "",
    threads: int = 2,
    compiled: bool = True,
) -> str:
    """examples/demo.toml on these ports, its models in `cache`, llama-server on `threads`
    threads, plus `extra` TOML, with a monitor port of its own unless `extra` gives one. The
    ports are set in the text: reading it gives each runtime the [backend] port by default.
    `compiled=False`: vLLM with --enforce-eager, as the demo ran before it compiled (each first
    start of a compiled recipe takes about 90 s more here)."""
    text = (REPO / "examples" / "demo.toml").read_text().replace("~/.cache/b70", cache)
    if not compiled:
        args = 'args = ["--max-model-len"'
        if args not in text:
            raise ValueError(f"examples/demo.toml: no `{args}` to add --enforce-eager to")
        text = text.replace(args, 'args = ["--enforce-eager", "--max-model-len"')
    text = text.replace('"--threads", "2"', f'"--threads", "{threads}"')
    text = text.replace("port = 8000", f"port = {proxy_port}")
    text = text.replace("port = 8001", f"port = {backend_port}")
    if "[monitor]" not in extra:  # a monitor of its own, beside any other appliance
        # free_port() knows nothing of the ports given here, which nothing may hold yet
        monitor_port = free_port()
        while monitor_port in (proxy_port, backend_port):
            monitor_port = free_port()
        text += f"\n[monitor]\nport = {monitor_port}\n"
    return text + extra


@dataclass
class Demo:
    env: dict[str, str]  # reaches the private manager
    b70ctl: list[str]  # b70ctl --user --config CONFIG
    proxy_port: int = 0
    backend_port: int = 0

    @property
    def key_file(self) -> Path:
        return Path(self.env["XDG_CONFIG_HOME"]) / "b70" / "proxy.env"

    @property
    def key(self) -> str:
        return self.key_file.read_text().split("=", 1)[1].strip()


@contextmanager
def term_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the block (in the main thread), so that a benchmark stopped
    by `kill` or `timeout` unwinds and removes what it started, as Ctrl-C does; a second SIGTERM
    while it unwinds is ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def demo_appliance(
    cache: str,
    extra: str = "",
    prefix: str = "b70-bench.",
    key_from: Path | None = None,
    threads: int = 2,
    b70ctl: str = B70CTL,
    rewrite: Callable[[str], str] | None = None,
    manager_env: dict[str, str] | None = None,
    compiled: bool = False,
    install_args: tuple[str, ...] = (),
) -> Iterator[Demo]:
    """examples/demo.toml with the models in `cache`, on free ports, plus `extra` TOML; with
    `key_from`, that proxy.env's key (a fleet shares one); llama-server on `threads` threads
    (two boxes on one 2-core machine want 1 each: llama.cpp's threads spin while they wait for
    each other, and two servers of 2 threads on 2 cores slow each other to a crawl); `b70ctl`
    installs it, and its units run that one; `rewrite`, the config's text as it is written;
    `manager_env`, more of the manager's environment, which its units and b70ctl see;
    `compiled`: vLLM with torch.compile as the demo runs it (the benchmarks measure the switch
    without it, as they did before the demo compiled, unless they measure the compile cache);
    `install_args`, install's (--warm). Its units' caches (%C) are its own, removed with it."""
    with term_as_exit():
        yield from _demo_appliance(
            cache,
            extra,
            prefix,
            key_from,
            threads,
            b70ctl,
            rewrite,
            manager_env,
            compiled,
            install_args,
        )


def _demo_appliance(
    cache: str, extra: str, prefix: str, key_from: Path | None, threads: int, b70ctl: str,
    rewrite: Callable[[str], str] | None, manager_env: dict[str, str] | None, compiled: bool,
    install_args: tuple[str, ...],
) -> Iterator[Demo]:  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix=prefix))
    env = dict(os.environ, XDG_CONFIG_HOME=str(root / "config"), XDG_STATE_HOME=str(root / "state"))
    env["XDG_CACHE_HOME"] = str(root / "cache")
    subprocess.run([USER_MANAGER, "start", str(root / "mgr")], env=env, check=True)
    for line in (root / "mgr" / "env").read_text().splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value
    for key, value in (manager_env or {}).items():
        subprocess.run(
            ["systemctl", "--user", "set-environment", f"{key}={value}"], env=env, check=True
        )
        env[key] = value
    proxy_port, backend_port = free_port(), free_port()
    config = root / "appliance.toml"
    text = demo_text(proxy_port, backend_port, cache, extra, threads, compiled)
    config.write_text(rewrite(text) if rewrite is not None else text)
    demo = Demo(env, [b70ctl, "--user", "--config", str(config)], proxy_port, backend_port)
    if key_from is not None:
        demo.key_file.parent.mkdir(parents=True, exist_ok=True)
        demo.key_file.write_bytes(key_from.read_bytes())
        demo.key_file.chmod(0o600)
    try:
        subprocess.run(
            [*demo.b70ctl, "install", *install_args], env=env, check=True, capture_output=True
        )
        yield demo
    finally:
        subprocess.run([*demo.b70ctl, "uninstall", "--purge"], env=env, capture_output=True)
        subprocess.run([USER_MANAGER, "stop", str(root / "mgr")], env=env)
        shutil.rmtree(root, ignore_errors=True)  # its config, journal and state, now unused


def recipe_folder(env: dict[str, str], runtime: str) -> Path:
    """A runtime's recipe folder in its lasting cache, as its installed unit's guard names it
    (`--cache %C/b70-NAME/RECIPE`), on the host of the manager whose environment `env` is."""
    unit = Path(env["XDG_CONFIG_HOME"]) / "systemd" / "user" / f"b70-{runtime}.service"
    pre = [line for line in unit.read_text().splitlines() if line.startswith("ExecStartPre=")]
    words = pre[-1].split()
    return Path(words[words.index("--cache") + 1].replace("%C", env["XDG_CACHE_HOME"]))
