"""Who holds a port: the /proc reading that settles most preflights, and psutil where it cannot."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.host import processes

PORT = 8001
TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def tcp_line(port: int, state: str, inode: int) -> str:
    return (
        f"   0: 0100007F:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 "
        f"00000000     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )


def proc_tree(root: Path, tcp: list[str], tcp6: list[str] | None = None) -> Path:
    """/proc/net/tcp (and tcp6 when given) in the kernel's layout."""
    (root / "net").mkdir(parents=True)
    (root / "net" / "tcp").write_text(TCP_HEADER + "".join(tcp))
    if tcp6 is not None:
        (root / "net" / "tcp6").write_text(TCP_HEADER + "".join(tcp6))
    return root


def process(root: Path, pid: int, children: list[int], sockets: list[int]) -> None:
    """/proc/PID/task/PID/children and /proc/PID/fd/N -> socket:[INODE], as the kernel shows."""
    task = root / str(pid) / "task" / str(pid)
    task.mkdir(parents=True)
    (task / "children").write_text("".join(f"{c} " for c in children))
    fd = root / str(pid) / "fd"
    fd.mkdir()
    (fd / "0").symlink_to("/dev/null")
    for n, inode in enumerate(sockets, start=3):
        (fd / str(n)).symlink_to(f"socket:[{inode}]")


@pytest.fixture
def no_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail where psutil's scan is asked: /proc was meant to settle it."""

    import psutil

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("psutil was asked")

    monkeypatch.setattr(psutil, "net_connections", refuse)
    monkeypatch.setattr(psutil, "Process", refuse)


def test_nobody_listening_is_read_from_proc_alone(tmp_path: Path, no_psutil: None) -> None:
    proc = proc_tree(tmp_path, [tcp_line(PORT, "01", 11), tcp_line(PORT + 1, "0A", 12)], [])
    assert processes.listening_sockets(PORT, str(proc)) == set()
    assert processes.foreign_listeners(PORT, [100], str(proc)) == []


def test_a_listener_held_by_a_units_child_is_ours(tmp_path: Path, no_psutil: None) -> None:
    proc = proc_tree(tmp_path, [], [tcp_line(PORT, "0A", 77)])  # an IPv6 socket
    process(proc, 100, children=[101], sockets=[])
    process(proc, 101, children=[], sockets=[55, 77])
    assert processes.listening_sockets(PORT, str(proc)) == {77}
    assert processes.foreign_listeners(PORT, [100], str(proc)) == []


def test_a_listener_outside_the_units_is_described_by_psutil(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = proc_tree(tmp_path, [tcp_line(PORT, "0A", 77)])
    process(proc, 100, children=[], sockets=[55])
    stranger = processes.Listener(4242, "python3 -m http.server 8001")
    monkeypatch.setattr(processes, "_scanned", lambda port: [stranger])
    monkeypatch.setattr(processes, "process_tree", lambda pid: {pid})
    assert processes.foreign_listeners(PORT, [100], str(proc)) == [stranger]


def test_an_unreadable_proc_falls_back_to_psutil(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = tmp_path / "proc"  # no net/tcp at all
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text(TCP_HEADER + f"   0: 0100007F:{PORT:04X} garbage\n")
    asked: list[int] = []
    monkeypatch.setattr(processes, "_scanned", lambda port: asked.append(port) or [])
    assert processes.listening_sockets(PORT, str(proc)) is None
    assert processes.foreign_listeners(PORT, [], str(proc)) == []
    assert asked == [PORT]


@pytest.fixture
def listening() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A real listener in a child process (its parent is this test)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen(); print('ready', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        yield port, child
    finally:
        child.kill()
        child.wait()


def test_the_real_proc_agrees_with_psutil(listening: tuple[int, subprocess.Popen[bytes]]) -> None:
    port, child = listening
    assert processes.listening_sockets(port)  # seen in this machine's /proc/net
    assert processes.foreign_listeners(port, [os.getpid()]) == []  # our child's
    foreign = processes.foreign_listeners(port, [])
    assert [listener.pid for listener in foreign] == [child.pid]
    assert processes.describe(foreign).startswith(f"pid {child.pid} (")


def test_a_free_port_is_known_free_without_psutil(no_psutil: None) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening
        assert processes.listening_sockets(port) == set()
        assert processes.foreign_listeners(port, []) == []
        assert processes.listeners(port) == []


def test_a_containers_server_is_the_appliances(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime in a container serves from outside its unit's process tree (host network): the
    port check asks the engine for the container's processes before it calls one foreign."""
    from appliance.config import parse
    from appliance.errors import ApplianceError
    from appliance.units import serving as units

    class Manager:
        def main_pid(self, unit: str) -> int:
            return 100  # the engine's client, the unit's main process

    server = processes.Listener(4242, "python3 -m vllm.entrypoints.openai.api_server")
    monkeypatch.setattr(processes, "foreign_listeners", lambda port, pids: [server])
    cfg = parse('default_runtime = "v"\n[runtimes.v]\nengine = "vllm"\nmodel = "/m"\n', Path("t"))
    asked: list[object] = []
    monkeypatch.setattr(units, "container_pids", lambda config: asked.append(config) or {4242})
    units.check_port(Manager(), ["b70-v.service"], PORT, "backend", cfg)  # type: ignore[arg-type]
    assert asked == [cfg]
    with pytest.raises(ApplianceError, match="held by pid 4242"):
        units.check_port(Manager(), ["b70-v.service"], PORT, "backend")  # type: ignore[arg-type]
    monkeypatch.setattr(units, "container_pids", lambda config: set())
    with pytest.raises(ApplianceError, match="not part of the appliance"):
        units.check_port(Manager(), ["b70-v.service"], PORT, "backend", cfg)  # type: ignore[arg-type]


def test_addresses_read_as_the_kernel_writes_them() -> None:
    assert processes.address("0100007F:BB81") == "127.0.0.1:48001"
    assert processes.address("00000000000000000000000001000000:1F41") == "[::1]:8001"
    assert processes.address("0000000000000000FFFF00000100007F:0050") == "127.0.0.1:80"


@pytest.fixture
def connection_end() -> Iterator[tuple[int, int, socket.socket, socket.socket]]:
    """A connection on loopback whose local end is a port of our choosing, as an outgoing
    connection's is when the kernel picks it: (that port, the server's, both ends)."""
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.bind(("127.0.0.1", 0))
        client.connect(server.getsockname())
        accepted, _ = server.accept()
        with accepted:
            yield client.getsockname()[1], server.getsockname()[1], client, accepted


def test_a_connections_local_end_holds_the_port_though_nobody_listens(
    connection_end: tuple[int, int, socket.socket, socket.socket],
) -> None:
    port, server, _, _ = connection_end
    assert processes.listeners(port) == []
    assert processes.bind_refused("127.0.0.1", port)
    ends = processes.local_ends(port)
    assert ends == [f"the local end of a connection to 127.0.0.1:{server} (ESTABLISHED)"]


def test_a_free_port_is_not_refused() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert not processes.bind_refused("127.0.0.1", port)
    assert processes.local_ends(port) == []
    # Not this check's to answer: the runtime reports these itself.
    assert not processes.bind_refused("no-such-host.invalid", port)
    assert not processes.bind_refused("192.0.2.1", port)  # not an address of this machine


def test_the_ephemeral_range_is_read_from_the_kernels_file(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("32768\t60999\n")
    assert processes.ephemeral_range(str(tmp_path / "range")) == (32768, 60999)
    (tmp_path / "range").write_text("garbage\n")
    assert processes.ephemeral_range(str(tmp_path / "range")) is None
    assert processes.ephemeral_range(str(tmp_path / "absent")) is None


def unit_pre_argv(port: int) -> list[str]:
    from tests.conftest import B70CTL

    return [B70CTL, "unit", "pre", "--port", str(port)]


def unit_pre(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*unit_pre_argv(port), *extra], capture_output=True, text=True, timeout=30
    )


def test_the_units_guard_names_a_connection_that_holds_the_port(
    connection_end: tuple[int, int, socket.socket, socket.socket],
) -> None:
    """Nothing listens on the port, but the runtime could not bind it: the guard says what holds
    it, and where the kernel's range for outgoing connections is, how to keep out of it."""
    port, server, _, _ = connection_end
    out = unit_pre(port, "--wait", "0")
    assert out.returncode == 1, out.stderr
    assert (
        f"error: port {port} on 127.0.0.1 is held by the local end of a connection to "
        f"127.0.0.1:{server} (ESTABLISHED)"
    ) in out.stderr
    span = processes.ephemeral_range()
    assert span is not None
    if span[0] <= port <= span[1]:  # bind(0) picks from that range
        assert f"choose a [backend] port below {span[0]}" in out.stderr
        assert f"net.ipv4.ip_local_reserved_ports={port}" in out.stderr


def test_the_units_guard_waits_for_that_connection_to_close(
    connection_end: tuple[int, int, socket.socket, socket.socket],
) -> None:
    port, _, client, accepted = connection_end
    guard = subprocess.Popen(
        [*unit_pre_argv(port), "--wait", "20"], stderr=subprocess.PIPE, text=True
    )
    try:
        time.sleep(0.5)
        assert guard.poll() is None, "the guard waits while the port is held"
        # The server's end closes first, as a runtime's does: the client's end leaves no
        # TIME_WAIT on the port.
        accepted.close()
        client.recv(1)
        client.close()
        assert guard.wait(timeout=20) == 0, guard.stderr.read() if guard.stderr else ""
    finally:
        guard.kill()
        guard.wait()
