"""The guards every runtime unit runs around its main process, whoever started it.

`pre`, the port guard (ExecStartPre=, after the GPU-memory guard in the same process:
appliance.host.gpu.fit): the backend port must be free; a runtime that still holds it is given a
moment, a foreign process is named and refused. Free means that the runtime could bind it, not
only that nothing listens there: an outgoing connection's local end holds a port as well.

`cache`, the cache guard (ExecStartPre=, last): the runtime's lasting cache
(appliance.engines.lasting) is made, kept under its bound, and said to be warm or cold in one
line; where it cannot serve, the start goes on cold, through the unit's environment file.

`ready`, the health guard (ExecStartPost=): poll the health URL until it answers 200 from the
unit's own process. systemd keeps waiting if the main process dies during ExecStartPost, so the
guard checks it on every poll; and a stale server on the same port must not pass for ours, so
the listener's pid must belong to the unit's process tree (or to its container).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from appliance import engines
from appliance.config import Engine
from appliance.engines import lasting
from appliance.errors import ApplianceError
from appliance.host import health, processes

POLL_S = 0.1


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pre(port: int, wait_s: float, host: str) -> None:
    """Wait up to `wait_s` for the runtime's `host:port` to be free; then name what holds it."""
    deadline = time.monotonic() + wait_s
    while True:
        problem = port_problem(host, port)
        if problem is None:
            return
        if time.monotonic() >= deadline:
            raise problem
        time.sleep(POLL_S)


def port_problem(host: str, port: int) -> ApplianceError | None:
    """Why the runtime could not bind `host:port` now: a process listens there, or a socket
    holds it without listening (most often an outgoing connection's local end)."""
    found = processes.listeners(port)
    if found:
        return ApplianceError(
            f"port {port} is in use by {processes.describe(found)}",
            hint="stop that process, or choose another [backend] port in the config",
            code="port_busy",
        )
    if not processes.bind_refused(host, port):
        return None
    ends = processes.local_ends(port) or ["a socket that neither listens nor connects"]
    span = processes.ephemeral_range()
    if span and span[0] <= port <= span[1]:
        hint = (
            f"the kernel gives ports {span[0]}-{span[1]} to outgoing connections "
            "(net.ipv4.ip_local_port_range): choose a [backend] port below "
            f"{span[0]}, or reserve this one: sysctl -w net.ipv4.ip_local_reserved_ports={port}"
        )
    else:
        hint = "wait for it to close, or choose another [backend] port in the config"
    return ApplianceError(
        f"port {port} on {host} is held by {', '.join(ends[:3])}", hint=hint, code="port_busy"
    )


def cache(folder: Path, engine: Engine, names: Collection[str], max_bytes: int) -> lasting.Prepared:
    """Ready the recipe's folder before a start, and say in one line what the start finds. The
    environment file goes to the unit's RuntimeDirectory= (systemd names it in
    $RUNTIME_DIRECTORY); run by hand, there is none."""
    where = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    env_file = Path(where) / lasting.ENV_FILE if where else None
    found = lasting.prepare(folder, engines.of(engine), names, max_bytes, env_file)
    if found.dropped:
        gone = ", ".join(found.dropped)
        log(f"{lasting.LINE} dropped {gone} to stay under {lasting.mib(max_bytes)}")
    log(found.line)
    return found


@dataclass(frozen=True)
class ReadyTarget:
    url: str
    engine: str
    port: int
    pid: int
    container: str | None = None
    container_cli: str | None = None


def owned_pids(target: ReadyTarget) -> set[int]:
    pids = processes.process_tree(target.pid)
    if target.container and target.container_cli:
        cpid = processes.container_pid(target.container_cli, target.container)
        if cpid:
            pids |= processes.process_tree(cpid)
    return pids


def ready(target: ReadyTarget) -> float:
    """Block until healthy; return the seconds it took. Raises when the process dies."""
    start = time.monotonic()
    url = health.health_url(target.url, target.engine)
    last = ""
    while True:
        if not processes.pid_alive(target.pid):
            raise ApplianceError(
                f"the main process (pid {target.pid}) exited before {url} answered"
                + (f" (last probe: {last})" if last else ""),
                code="runtime_died",
            )
        result = health.probe(url)
        last = result.detail
        if result.healthy:
            found = processes.listeners(target.port)
            ours = owned_pids(target)
            if any(listener.pid in ours for listener in found):
                took = time.monotonic() - start
                log(f"healthy after {took:.1f} s: {url} answers from pid {target.pid}")
                return took
            if found:
                holder = processes.describe(found)
                raise ApplianceError(
                    f"{url} answers, but port {target.port} belongs to {holder}, "
                    f"not to this unit's process (pid {target.pid})",
                    hint="stop the stale server that holds the port",
                    code="port_busy",
                )
        time.sleep(POLL_S)
