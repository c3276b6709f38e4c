"""The systemd edge: the only module that imports pystemd.

A user manager is reached over $XDG_RUNTIME_DIR/systemd/private (what systemctl --user does, no
session bus needed); the system manager over /run/systemd/private as root, else the system bus.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import select
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.layout import Scope

DESTINATION = b"org.freedesktop.systemd1"
UNIT_INTERFACE = b"org.freedesktop.systemd1.Unit"
SERVICE_INTERFACE = b"org.freedesktop.systemd1.Service"
MANAGER_INTERFACE = b"org.freedesktop.systemd1.Manager"
MANAGER_PATH = b"/org/freedesktop/systemd1"


@dataclass(frozen=True)
class UnitProperties:
    """A unit as its manager describes it: the properties the appliance reads, under systemd's
    own names (LoadState as load_state, and so on)."""

    name: str
    load_state: str
    active_state: str
    sub_state: str
    result: str | None
    main_pid: int | None
    invocation_id: str | None
    active_enter_us: int | None
    exec_main_status: int | None
    job_pending: bool
    unit_file_state: str | None
    n_restarts: int | None = None

    @property
    def settled(self) -> bool:
        """No job is pending and the unit is not on its way somewhere."""
        return not self.job_pending and self.active_state not in {"activating", "deactivating"}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def bus_address(scope: Scope) -> bytes | None:
    if scope is Scope.USER:
        runtime_dir = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
        socket = Path(runtime_dir) / "systemd" / "private"
        if not socket.exists():
            raise ApplianceError(
                f"no user manager is listening on {socket}",
                hint="start one (`systemctl --user` needs a login session or "
                "`loginctl enable-linger`), or run scripts/user-manager on a machine without "
                "systemd as PID 1",
                code="systemd_unreachable",
            )
        return b"unix:path=" + str(socket).encode()
    socket = Path("/run/systemd/private")
    if os.geteuid() == 0 and socket.exists():
        return b"unix:path=" + str(socket).encode()
    return None


class Systemd:
    """One connection to one manager."""

    def __init__(self, bus: Any, scope: Scope) -> None:
        self.bus = bus
        self.scope = scope
        self._subscribed = False

    def _manager(self, method: bytes, signature: bytes = b"", *args: Any) -> Any:
        """Call a method of the manager's interface, with its D-Bus signature. pystemd's
        Manager object would introspect the manager first, and parse the XML with lxml."""
        from pystemd.dbuslib import apply_signature

        call = apply_signature(signature, list(args)) if signature else []
        reply = self.bus.call_method(DESTINATION, MANAGER_PATH, MANAGER_INTERFACE, method, call)
        return reply.body

    def _get(self, name: str, interface: bytes, prop: bytes, kind: bytes) -> Any:
        from pystemd.dbuslib import path_encode

        path = path_encode(b"/org/freedesktop/systemd1/unit", name.encode())
        return self.bus.get_property(DESTINATION, path, interface, prop, kind)

    def properties(self, name: str) -> UnitProperties:
        """The unit's properties, read one Get each: pystemd's Unit().load() would introspect the
        unit first, and GetAll reads the hundreds of properties of a service."""

        def unit(prop: bytes, kind: bytes) -> Any:
            return self._get(name, UNIT_INTERFACE, prop, kind)

        def service(prop: bytes, kind: bytes) -> Any:
            return self._get(name, SERVICE_INTERFACE, prop, kind) if is_service else None

        is_service = name.endswith(".service")
        from pystemd.dbusexc import DBusFileNotFoundError, DBusNoSuchUnitError

        try:
            file_state = _text(self._manager(b"GetUnitFileState", b"s", name.encode()))
        except (DBusFileNotFoundError, DBusNoSuchUnitError):  # no unit file: nothing to enable
            file_state = None
        invocation = unit(b"InvocationID", b"ay")
        main_pid = service(b"MainPID", b"u")
        result, status = service(b"Result", b"s"), service(b"ExecMainStatus", b"i")
        restarts = service(b"NRestarts", b"u")
        return UnitProperties(
            name=name,
            load_state=_text(unit(b"LoadState", b"s")),
            active_state=_text(unit(b"ActiveState", b"s")),
            sub_state=_text(unit(b"SubState", b"s")),
            result=_text(result) if result is not None else None,
            main_pid=int(main_pid or 0) or None,
            invocation_id=bytes(invocation).hex() if invocation else None,
            active_enter_us=int(unit(b"ActiveEnterTimestamp", b"t")) or None,
            exec_main_status=int(status) if status is not None else None,
            job_pending=int(unit(b"Job", b"(uo)")[0]) != 0,
            unit_file_state=file_state,
            n_restarts=int(restarts) if restarts is not None else None,
        )

    # One property each, for the questions a switch asks on its way, where properties() asks
    # for a dozen and UnitFileState.

    def active_state(self, name: str) -> str:
        return _text(self._get(name, UNIT_INTERFACE, b"ActiveState", b"s"))

    def load_state(self, name: str) -> str:
        return _text(self._get(name, UNIT_INTERFACE, b"LoadState", b"s"))

    def sub_state(self, name: str) -> str:
        return _text(self._get(name, UNIT_INTERFACE, b"SubState", b"s"))

    def main_pid(self, name: str) -> int | None:
        return int(self._get(name, SERVICE_INTERFACE, b"MainPID", b"u") or 0) or None

    def wait_change(self, timeout_s: float) -> None:
        """Wait until the manager says something (a unit's properties changed, a job ended) or
        `timeout_s` passes. On the manager's private socket systemd sends every unit's signals
        to every client; on the system bus it sends them to subscribers, hence Subscribe().

        The wait is a poll(2) on the bus's socket from Python, which lets other threads run
        meanwhile (pystemd's own wait holds the interpreter while it blocks)."""
        if not self._subscribed:
            self._subscribed = True
            with contextlib.suppress(Exception):  # without signals this waits out the timeout
                self._manager(b"Subscribe")
        if self._read_queued():  # already read off the socket: poll(2) would not see it
            return
        poller = select.poll()
        poller.register(self.bus.get_fd(), select.POLLIN)
        poller.poll(max(1, math.ceil(timeout_s * 1000)))
        self._read_queued()

    def _read_queued(self) -> bool:
        """Read and let go what came (no callback is registered); whether anything had."""
        for n in range(256):
            if self.bus.process().is_empty():
                return n > 0
        return True

    def _unit_job(self, method: bytes, name: str, mode: str) -> Any:
        return self._manager(method, b"ss", name.encode(), mode.encode())

    def start(self, name: str, mode: str = "replace") -> None:
        self._call("start", name, lambda: self._unit_job(b"StartUnit", name, mode))

    def restart(self, name: str, mode: str = "replace") -> None:
        self._call("restart", name, lambda: self._unit_job(b"RestartUnit", name, mode))

    def stop(self, name: str, mode: str = "replace") -> None:
        self._call("stop", name, lambda: self._unit_job(b"StopUnit", name, mode))

    def reset_failed(self, name: str) -> None:
        with contextlib.suppress(Exception):  # a unit that is not loaded has nothing to reset
            self._manager(b"ResetFailedUnit", b"s", name.encode())

    def reload(self) -> None:
        self._call("daemon-reload", "the manager", lambda: self._manager(b"Reload"))

    def enable(self, names: Sequence[str]) -> None:
        if names:
            files = [n.encode() for n in names]
            self._call(
                "enable",
                ", ".join(names),
                lambda: self._manager(b"EnableUnitFiles", b"asbb", files, False, True),
            )

    def disable(self, names: Sequence[str]) -> None:
        if names:
            files = [n.encode() for n in names]
            self._call(
                "disable",
                ", ".join(names),
                lambda: self._manager(b"DisableUnitFiles", b"asb", files, False),
            )

    def _call(self, what: str, name: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # pystemd raises DBusError subclasses with the D-Bus message
            raise ApplianceError(
                f"systemd refused to {what} {name}: {e}",
                hint=f"see `{systemctl_command(self.scope)} status {name}`",
                code="systemd_refused",
            ) from e


def _import_bus_binding() -> None:
    """Import pystemd's sd-bus binding (pystemd.dbuslib) without pystemd's package __init__.

    That __init__ only re-exports pystemd's object layer (pystemd.base), which imports lxml to
    parse the introspection XML this module never asks for, on every b70ctl that connects
    (docs/startup.md compares the two imports). Where pystemd is already imported whole, or the
    binding needs more of its package than it does today, pystemd is imported the usual way."""
    if "pystemd" in sys.modules:
        return
    spec = importlib.util.find_spec("pystemd")
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed: the import below says so
    sys.modules["pystemd"] = importlib.util.module_from_spec(spec)  # its __init__ not run
    try:
        importlib.import_module("pystemd.dbuslib")
        importlib.import_module("pystemd.dbusexc")
    except ImportError:
        for name in [n for n in sys.modules if n == "pystemd" or n.startswith("pystemd.")]:
            del sys.modules[name]


@contextmanager
def connect(scope: Scope) -> Iterator[Systemd]:
    _import_bus_binding()
    from pystemd.dbuslib import DBus, DBusAddress

    address = bus_address(scope)
    try:
        bus_cm = DBusAddress(address, peer_to_peer=True) if address else DBus()
        bus = bus_cm.__enter__()
    except Exception as e:
        raise ApplianceError(
            f"cannot reach the {scope} manager: {e}",
            hint="is systemd running? for a user manager, is XDG_RUNTIME_DIR set?",
            code="systemd_unreachable",
        ) from e
    try:
        yield Systemd(bus, scope)
    finally:
        bus_cm.__exit__(None, None, None)


def systemctl_command(scope: Scope) -> str:
    return "systemctl --user" if scope is Scope.USER else "systemctl"


# Who may read the system journal besides root (journald's file ACLs on Debian and Fedora).
JOURNAL_GROUPS = ("systemd-journal", "adm", "wheel")


def require_journal(scope: Scope) -> None:
    """The system journal is root's and its readers' groups': anyone else is told which group to
    join, rather than journalctl's "No journal files were opened"."""
    if scope is Scope.USER or os.geteuid() == 0 or os.environ.get("B70_JOURNAL_DIR"):
        return
    import grp

    mine = set(os.getgroups()) | {os.getegid()}
    readers = {g.gr_gid for g in grp.getgrall() if g.gr_name in JOURNAL_GROUPS}
    if mine & readers:
        return
    raise ApplianceError(
        "the system journal is readable by root and the systemd-journal group, and you are in "
        "neither",
        hint="ask an admin to add you: `sudo usermod -aG systemd-journal $USER`, then log in "
        "again (or run `sudo b70ctl logs ...`)",
        code="not_permitted",
    )


def journal_command(
    scope: Scope, unit: str, lines: int, follow: bool = False, since: float | None = None
) -> list[str]:
    """journalctl for a unit's last `lines`; `since` (epoch seconds) leaves out older lines."""
    argv = ["journalctl", "--no-pager", "-o", "short-iso", "-n", str(lines)]
    if since is not None:
        argv.append(f"--since=@{since:.6f}")
    journal_dir = os.environ.get("B70_JOURNAL_DIR")
    if journal_dir:
        argv += ["-D", journal_dir]  # a private manager's own journald (scripts/user-manager)
    elif scope is Scope.USER:
        argv.append("--user")
    argv += ["-u", unit]
    if follow:
        argv.append("-f")
    return argv


def journal_excerpt(scope: Scope, unit: str, lines: int = 30, since: float | None = None) -> str:
    from appliance import run  # subprocess: only when a journal is read

    out = run.ask(journal_command(scope, unit, lines, since=since), timeout_s=10)
    return out.stdout.strip() if out is not None else ""
