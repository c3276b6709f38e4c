"""The systemd sandbox of every unit, as data: which directives, with what values, and why.

Rendering writes these lines through templates/sandbox.j2. Every unit gets the same base; what
differs is the unit's job:

- the proxy (the one unit on the network): no capabilities at all, its own user, and only its
  folder of held-request counts writable;
- the monitor: root, because it reads GPU memory from other users' /proc/PID/fdinfo and restarts
  units over systemd's private socket (root only); its capabilities are cut to exactly that;
- a native runtime: the GPU and nothing else (render nodes, the render group, CAP_PERFMON);
- a docker runtime: only the docker CLI runs in the unit, so it gets the runtime's sandbox too;
- a podman runtime: podman is the container engine itself, so its unit is left as it is.

Each directive left out for a reason says so in the unit, as a comment.

Identity (User=, Group=, SupplementaryGroups=, AmbientCapabilities=) exists only in system
scope: a user manager runs everything as its own user. The rest is the same in both scopes; only
where files live differs (a user's files are in home, and tests keep theirs in /tmp).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.config import Config, Engine, Launcher, RuntimeConfig, is_loopback
from appliance.layout import Scope, cache_name

if TYPE_CHECKING:
    from appliance.layout import Layout

PROXY_USER = "b70-proxy"
HELD_DIR = "held"  # appliance.hold.HELD_DIR: the only place the proxy writes
SYSTEM_STATE_ROOT = Path("/var/lib")  # StateDirectory= names paths under it
SYSTEM_CACHE_ROOT = Path("/var/cache")  # CacheDirectory= names paths under it
TMP_ROOTS = ("/tmp", "/var/tmp")  # PrivateTmp= gives the unit its own
HOME_ROOTS = ("/home", "/root", "/run/user")  # ProtectHome=yes hides them
GPU_DEVICES = "char-drm rw"  # every DRM node; file modes leave the b70 user the render nodes
GPU_CAPABILITY = "CAP_PERFMON"  # the xe driver's used-VRAM query needs it


@dataclass(frozen=True)
class Directive:
    key: str  # empty: a comment alone
    value: str = ""
    why: str = ""  # a comment above the line


def _base(clock: bool = True) -> list[Directive]:
    """What every sandboxed unit gets."""
    out = [
        Directive("NoNewPrivileges", "yes"),
        Directive(
            "ProtectSystem",
            "strict",
            "The whole file system is read-only; what this unit may write is named below.",
        ),
        Directive("PrivateMounts", "yes"),
        Directive("ProtectKernelTunables", "yes"),
        Directive("ProtectKernelModules", "yes"),
        Directive("ProtectKernelLogs", "yes"),
        Directive("ProtectControlGroups", "yes"),
        Directive("ProtectHostname", "yes"),
        Directive("RestrictNamespaces", "yes"),
        Directive("RestrictRealtime", "yes"),
        Directive("RestrictSUIDSGID", "yes"),
        Directive("LockPersonality", "yes"),
        Directive("RemoveIPC", "yes"),
        Directive("KeyringMode", "private"),
        Directive("SystemCallArchitectures", "native"),
        Directive("SystemCallFilter", "@system-service"),
        Directive(
            "SystemCallErrorNumber", "EPERM", "A refused system call fails; it does not kill."
        ),
        Directive("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
    ]
    if clock:
        out.append(Directive("ProtectClock", "yes"))
    else:
        out.append(
            Directive(
                "",
                why="No ProtectClock=: it would add /dev/rtc to the device list. The clock stays "
                "out of reach anyway: no CAP_SYS_TIME, and @clock is not in @system-service.",
            )
        )
    return out


def _gpu() -> list[Directive]:
    return [
        Directive(
            "DevicePolicy",
            "closed",
            "Devices: the GPU's DRM nodes and the pseudo-devices (null, zero, random...), no more.",
        ),
        Directive("DeviceAllow", GPU_DEVICES),
    ]


# --- where files are ---------------------------------------------------------------------------

_SAFE_PATH = re.compile(r"^[A-Za-z0-9_@+=,./-]+$")


def quote_path(path: str, optional: bool = True) -> str:
    """One path of ReadWritePaths=, BindPaths= and the like; '-' skips it when it is missing."""
    word = ("-" if optional else "") + path
    escaped = word.replace("%", "%%")
    if _SAFE_PATH.match(word):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _within(path: str, roots: Iterable[str]) -> bool:
    norm = os.path.normpath(path)
    return any(norm == r or norm.startswith(r + "/") for r in roots)


def _tmp_entry(path: str) -> str:
    """The entry directly in /tmp (or /var/tmp) that holds `path`."""
    norm = os.path.normpath(path)
    root = next((r for r in TMP_ROOTS if norm.startswith(r + "/")), None)
    return norm if root is None else root + "/" + norm[len(root) + 1 :].split("/", 1)[0]


def _files(
    lay: Layout,
    reads: Iterable[str],
    state: str | None,
    home: str = "yes",
) -> list[Directive]:
    """Private /tmp and home, the paths the unit reads from there, and what it may write.

    `state` is the part of the state directory the unit writes ("" all of it, None nothing).
    A user's files are in home (so home stays visible, read-only); a path under /tmp (a config
    or model kept there, as the tests do) is bound into the unit's private /tmp.
    """
    reads = sorted({os.path.normpath(p) for p in reads if os.path.isabs(p)})
    writes = [] if state is None else [str(lay.state_dir / state) if state else str(lay.state_dir)]
    if lay.scope is Scope.USER or any(_within(p, HOME_ROOTS) for p in [*reads, *writes]):
        home = "read-only"
    out = [Directive("PrivateTmp", "yes"), Directive("ProtectHome", home)]
    tmp_reads = sorted({_tmp_entry(p) for p in reads if _within(p, TMP_ROOTS)})
    if tmp_reads:
        paths = " ".join(quote_path(p) for p in tmp_reads)
        out.append(Directive("BindReadOnlyPaths", paths, "What it reads from /tmp."))
    if not writes:
        return out
    if lay.scope is Scope.SYSTEM:
        relative = Path(writes[0]).relative_to(SYSTEM_STATE_ROOT)
        why = "Writable, and made for the unit's user if missing; the rest of it is read-only."
        out.append(Directive("StateDirectory", str(relative), why))
        return out
    # A user manager cannot make a folder inside it (StateDirectory= is under ~/.config in
    # systemd 252): the whole state directory, which `b70ctl install` creates.
    why = "Writable: the state directory (a user manager cannot make a folder in it for the unit)."
    key = "BindPaths" if _within(str(lay.state_dir), TMP_ROOTS) else "ReadWritePaths"
    out.append(Directive(key, quote_path(str(lay.state_dir)), why))
    return out


def _cache(unit: str, env: Mapping[str, str]) -> list[Directive]:
    """A writable cache of the unit's own, since home is read-only (%C: /var/cache or ~/.cache).

    Where the config sets XDG_CACHE_HOME itself, its value stands.
    """
    name = cache_name(unit)
    out = [Directive("CacheDirectory", name, "Its own writable cache; home is read-only.")]
    if "XDG_CACHE_HOME" not in env:
        out.append(Directive("Environment", f"XDG_CACHE_HOME=%C/{name}"))
    return out


def _loopback_only(hosts: Iterable[str]) -> list[Directive]:
    """No address but loopback, when every address the unit listens on or talks to is one."""
    if not all(is_loopback(h) for h in hosts):
        return []
    return [
        Directive("IPAddressDeny", "any", "It talks to loopback only."),
        Directive("IPAddressAllow", "localhost"),
    ]


def _proxy_probe_host(config: Config) -> str:
    host = config.proxy.host
    return "127.0.0.1" if host in {"0.0.0.0", "::", ""} else host


def _runtime_reads(config: Config, rt: RuntimeConfig) -> list[str]:
    """What the runtime's unit (and a switch's preflight of it) reads."""
    if rt.launcher is not Launcher.NATIVE:
        return [config.docker if rt.launcher is Launcher.DOCKER else config.podman]
    # Files named in its arguments or environment (a chat template, a draft model) count too.
    named = [*rt.args, *rt.env.values()]
    return [rt.command[0], rt.model, *([rt.mmproj] if rt.mmproj else []), *named]


# --- per unit ----------------------------------------------------------------------------------


def proxy(config: Config, lay: Layout, program: str) -> list[Directive]:
    out = []
    if lay.scope is Scope.SYSTEM:
        out += [
            Directive("User", PROXY_USER, "Its own user (systemd-sysusers, b70-sysusers.conf)."),
            Directive("Group", PROXY_USER),
        ]
    out += [Directive("CapabilityBoundingSet", "", "No capabilities at all.")]
    out += _base()
    out += [
        Directive("PrivateDevices", "yes"),
        Directive("MemoryDenyWriteExecute", "yes"),
        Directive("SystemCallFilter", "~@privileged @resources"),
        Directive("UMask", "0077"),
        Directive(
            "",
            why="No ProtectProc=invisible: the request hold checks in /proc that the switch "
            "which wrote the hold mark (root's b70ctl) is still alive. No PrivateUsers=: "
            "systemd gives each Exec*= command a user namespace of its own, and the health gate "
            "(ExecStartPost=) must read the proxy's /proc/PID/fd to know the port is its own.",
        ),
    ]
    reads = [str(lay.proxy_config), config.b70ctl, program]
    reads += [p for p in (config.proxy.tls_cert, config.proxy.tls_key) if p]  # the owner's TLS
    reads += [p for p in (config.peers.ca, config.peers.redis_ca) if p]  # whom it trusts
    out += _files(lay, reads, state=HELD_DIR)
    out += _cache("b70-litellm.service", {})
    # Peers and their Redis: the proxy talks to them, so it is not loopback-only
    peers = [urllib.parse.urlsplit(url).hostname or "" for url in config.peers.urls]
    redis = [config.peers.redis_host] if config.peers.redis_host else []
    out += _loopback_only([config.proxy.host, config.backend.host, *peers, *redis])
    return out


def monitor(config: Config, lay: Layout) -> list[Directive]:
    containers = {rt.launcher for rt in config.runtimes.values()} - {Launcher.NATIVE}
    reads = [str(lay.etc_dir), config.b70ctl]
    for rt in config.runtimes.values():
        reads += _runtime_reads(config, rt)
    if not is_loopback(config.monitor.host):  # the status page serves the proxy's TLS there
        reads += [p for p in (config.proxy.tls_cert, config.proxy.tls_key) if p]
    out = [
        Directive(
            "CapabilityBoundingSet",
            "CAP_SYS_PTRACE CAP_DAC_READ_SEARCH CAP_PERFMON",
            "Root, for two things: systemd's private socket (restarts, failover) takes root, and "
            "GPU memory per process is in other users' /proc/PID/fdinfo (ptrace-read and "
            "directory search). CAP_PERFMON: the xe driver's used-VRAM query.",
        )
    ]
    out += [d for d in _base(clock=False) if d.key != "RestrictNamespaces" or not podman(config)]
    out += _gpu()
    out += [
        Directive("ProtectProc", "invisible", "With CAP_SYS_PTRACE it still sees every process."),
        Directive("MemoryDenyWriteExecute", "yes"),
        Directive("SystemCallFilter", "~@privileged @resources"),
    ]
    # The docker CLI reads its settings from ~/.docker (for a failover's preflight).
    home = "read-only" if containers else "yes"
    out += _files(lay, reads, state="", home=home)
    if podman(config):
        out += _podman_storage(lay)
    if lay.scope is Scope.USER:
        out.append(
            Directive(
                "BindReadOnlyPaths",
                "-%t",
                "The user manager's private socket is in the runtime directory (%t), which may "
                "be in /tmp (scripts/user-manager).",
            )
        )
    hosts = [config.backend.host, _proxy_probe_host(config), config.monitor.host]
    out += _loopback_only(hosts)
    return out


def podman(config: Config) -> bool:
    return any(rt.launcher is Launcher.PODMAN for rt in config.runtimes.values())


def _podman_storage(lay: Layout) -> list[Directive]:
    """podman locks its storage even to inspect an image: root's storage, and in a user manager
    also the user's own (a user manager of root's, as the tests run, uses root's)."""
    paths = "-/var/lib/containers -/run/containers -/run/libpod"
    if lay.scope is Scope.USER:
        paths = "-%h/.local/share/containers -%t/containers -%t/libpod " + paths
    return [
        Directive(
            "ReadWritePaths",
            paths,
            "podman takes locks in its storage even to inspect an image; rootless podman also "
            "enters its user namespace (so no RestrictNamespaces= here).",
        )
    ]


def runtime_identity(lay: Layout, rt: RuntimeConfig) -> list[Directive]:
    if lay.scope is not Scope.SYSTEM or not rt.user:
        return []
    return [
        Directive(
            "User",
            rt.user,
            "GPU access and no more: the render nodes through the render group, and "
            "CAP_PERFMON so that the memory gate (ExecStartPre) reads the used VRAM.",
        ),
        Directive("Group", rt.user),
        Directive("SupplementaryGroups", "render"),
        Directive("AmbientCapabilities", GPU_CAPABILITY),
    ]


def runtime(config: Config, lay: Layout, rt: RuntimeConfig) -> list[Directive]:
    if rt.launcher is Launcher.PODMAN:
        return [
            Directive(
                "",
                why="No sandbox: podman is the container engine itself (it mounts, makes "
                "namespaces and cgroups, writes its storage), so a sandbox here would stop it. "
                "A Quadlet .container unit (podman 4.4 and later) is the way to harden it.",
            )
        ]
    out = runtime_identity(lay, rt)
    reads = [config.b70ctl, *_runtime_reads(config, rt)]
    if rt.launcher is Launcher.DOCKER:
        out.append(
            Directive(
                "CapabilityBoundingSet",
                f"{GPU_CAPABILITY} CAP_SYS_PTRACE CAP_DAC_READ_SEARCH",
                "Only the docker CLI runs here; dockerd starts the container outside this unit. "
                "The health gate must see the container's processes (ptrace-read).",
            )
        )
    else:
        out.append(Directive("CapabilityBoundingSet", GPU_CAPABILITY))
    out += _base(clock=False)
    out += _gpu()
    out += [
        Directive("ProtectProc", "invisible"),
        Directive(
            "SystemCallFilter",
            "~@privileged",
            ""
            if rt.launcher is Launcher.DOCKER
            else "@resources stays allowed: engines pin threads to cores and memory to NUMA nodes.",
        ),
        Directive("UMask", "0077"),
    ]
    if rt.launcher is Launcher.DOCKER:
        return out + _docker_cli(config, lay, reads)
    return out + _native(lay, rt, reads)


def _docker_cli(config: Config, lay: Layout, reads: list[str]) -> list[Directive]:
    out = [Directive("MemoryDenyWriteExecute", "yes")]
    # The docker CLI reads its settings from ~/.docker.
    out += _files(lay, reads, state=None, home="read-only")
    # The CLI talks to dockerd over its socket; the container (--network host) is not in this
    # unit's cgroup, so its traffic is not limited here.
    return out + _loopback_only([config.backend.host])


def _native(lay: Layout, rt: RuntimeConfig, reads: list[str]) -> list[Directive]:
    out = [
        Directive(
            "",
            why="No MemoryDenyWriteExecute=: engines compile kernels at run time (oneAPI, "
            "torch). No PrivateUsers=: CAP_PERFMON must count outside the unit.",
        )
    ]
    if rt.engine is Engine.VLLM:
        out.append(
            Directive(
                "RestrictAddressFamilies",
                "AF_NETLINK",
                "vLLM's workers meet through torch.distributed (gloo), which lists the "
                "network interfaces over netlink.",
            )
        )
    out += _files(lay, reads, state=None)
    # Its CacheDirectory= is in every runtime unit, sandboxed or not (templates/runtime.service.j2)
    if "XDG_CACHE_HOME" not in rt.env:
        out.append(Directive("Environment", f"XDG_CACHE_HOME=%C/{cache_name(rt.unit)}"))
    return out
