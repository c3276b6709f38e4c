"""Who holds a port, process trees, and a container's process.

A switch asks, in its preflight, whether anything outside the appliance listens on the target's
port. Most often the answer is read straight from /proc: the sockets listening on the port
(/proc/net/tcp, tcp6), and whether the units' processes hold them (/proc/PID/fd): a few reads
of small files. psutil, which scans every process's sockets and would add its import and that
scan to the switch (docs/startup.md), is used only where /proc does not settle it, and to
describe what it finds.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

LISTEN = "0A"  # the TCP_LISTEN state as /proc/net/tcp writes it (include/net/tcp_states.h)


@dataclass(frozen=True)
class Listener:
    """A process listening on a port (pid None: another user's)."""

    pid: int | None
    command: str | None


def listeners(port: int) -> list[Listener]:
    """Processes listening on a TCP port (pid None: a socket of another user)."""
    if listening_sockets(port) == set():  # /proc says nobody: no need to scan every process
        return []
    return _scanned(port)


def _scanned(port: int) -> list[Listener]:
    """The listeners on `port`, from psutil's scan of every process's sockets."""
    import psutil

    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            found.append(Listener(conn.pid, _command(conn.pid)))
    return found


def _command(pid: int | None) -> str | None:
    import psutil

    if pid is None:
        return None
    try:
        return " ".join(psutil.Process(pid).cmdline()) or psutil.Process(pid).name()
    except psutil.Error:
        return None


def foreign_listeners(port: int, main_pids: list[int], proc: str = "/proc") -> list[Listener]:
    """Processes listening on `port` that are not in the process tree of any of `main_pids`."""
    sockets = listening_sockets(port, proc)
    if sockets == set():
        return []
    if sockets is not None:
        tree = _tree_from_proc(main_pids, proc)
        held = None if tree is None else _sockets_held(tree, proc)
        if held is not None and sockets <= held:
            return []
    ours: set[int] = set()
    for pid in main_pids:
        ours |= process_tree(pid)
    return [listener for listener in _scanned(port) if listener.pid not in ours]


def listening_sockets(port: int, proc: str = "/proc") -> set[int] | None:
    """The inodes of the TCP sockets listening on `port` in this network namespace; None when
    /proc/net cannot say (then psutil is asked)."""
    rows = _rows_on(port, proc)
    if rows is None:
        return None
    return {inode for state, _, inode in rows if state == LISTEN}


def _rows_on(port: int, proc: str) -> list[tuple[str, str, int]] | None:
    """(state, remote address, inode) of each TCP socket whose local port is `port`, from
    /proc/net/tcp and tcp6; None when they cannot be read."""
    found = []
    local = f":{port:04X} "  # the local address ends so; most lines are left at this test
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as f:
                next(f, None)  # the header
                for line in f:
                    if local not in line:
                        continue
                    fields = line.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port:
                        found.append((fields[3], fields[2], int(fields[9])))
        except FileNotFoundError:  # no tcp6 where IPv6 is off
            continue
        except (OSError, ValueError, IndexError):
            return None
    return found


# include/net/tcp_states.h, as /proc/net/tcp writes them
STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    LISTEN: "LISTEN",
    "0B": "CLOSING",
}


def address(hex_address: str) -> str:
    """`0100007F:BB81` (/proc/net/tcp: each 32-bit word in host order) as `127.0.0.1:48001`."""
    host, port = hex_address.rsplit(":", 1)
    raw = b"".join(
        int(host[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(host), 8)
    )
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:  # an IPv4 peer of a v6 socket
        ip = ip.ipv4_mapped
    if ip.version == 6:
        return f"[{ip}]:{int(port, 16)}"
    return f"{ip}:{int(port, 16)}"


def bind_refused(host: str, port: int) -> bool:
    """Whether a server that sets SO_REUSEADDR, as llama-server and uvicorn do, would be refused
    `host:port` (EADDRINUSE) now. Any other answer (a name that does not resolve, an address
    not on this machine, a port it may not bind) is the runtime's to report."""
    try:
        family, kind, _, _, where = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (OSError, UnicodeError):
        return False
    with socket.socket(family, kind) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(where)
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def local_ends(port: int, proc: str = "/proc") -> list[str]:
    """The connections whose local end is `port` (the kernel picks those from
    net.ipv4.ip_local_port_range). A socket that is bound and neither listens nor connects is
    not listed in /proc/net/tcp, nor here."""
    ends = []
    for state, remote, _ in _rows_on(port, proc) or []:
        if state == LISTEN:
            continue
        name = STATES.get(state, state)
        try:
            peer = address(remote)
        except ValueError:
            peer = remote
        ends.append(f"the local end of a connection to {peer} ({name})")
    return ends


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int] | None:
    """The ports the kernel gives outgoing connections' local ends."""
    try:
        with open(path) as f:
            low, high = (int(field) for field in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def _tree_from_proc(pids: Iterable[int], proc: str) -> set[int] | None:
    """`pids` and their descendants, from /proc/PID/task/TID/children; None where unreadable."""
    seen: set[int] = set()
    todo = [pid for pid in pids if pid]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            tasks = os.listdir(f"{proc}/{pid}/task")
        except FileNotFoundError:
            continue  # gone
        except OSError:
            return None
        for tid in tasks:
            try:
                with open(f"{proc}/{pid}/task/{tid}/children") as f:
                    todo += [int(child) for child in f.read().split()]
            except FileNotFoundError:
                continue  # the thread ended
            except (OSError, ValueError):
                return None  # a kernel without CONFIG_PROC_CHILDREN, or not ours to read
    return seen


def _sockets_held(pids: set[int], proc: str) -> set[int] | None:
    """The socket inodes the processes `pids` hold open; None where a process's fds cannot be
    read (another user's)."""
    held: set[int] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"{proc}/{pid}/fd")
        except FileNotFoundError:
            continue
        except OSError:
            return None
        for fd in fds:
            try:
                target = os.readlink(f"{proc}/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                held.add(int(target[8:-1]))
    return held


def describe(found: list[Listener]) -> str:
    parts = []
    for listener in found:
        if listener.pid is None:
            parts.append("a process of another user")
        else:
            parts.append(f"pid {listener.pid} ({(listener.command or '?')[:120]})")
    return ", ".join(parts)


def process_tree(pid: int) -> set[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return {pid} | {child.pid for child in root.children(recursive=True)}
    except psutil.Error:
        return set()


def container_pid(cli: str, name: str) -> int | None:
    from appliance import run  # subprocess: only for a runtime in a container

    out = run.ask([cli, "inspect", "--format", "{{.State.Pid}}", name], timeout_s=10)
    if out is None:
        return None
    text = out.stdout.strip()
    return int(text) if out.returncode == 0 and text.isdigit() and int(text) > 0 else None


def pid_alive(pid: int) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
