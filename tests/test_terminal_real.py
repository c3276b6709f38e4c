"""Ctrl-C typed on a real pseudo-terminal while `b70ctl switch` draws its moving line, in each
phase of the switch: the key goes to the terminal, and the terminal sends SIGINT to the whole
foreground process group, as it does for a person. Afterwards, each time: exit 130, one runtime
serving, that one enabled for boot and no other, the interruption recorded, and the next switch
works."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import signal
import struct
import termios
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.conftest import B70CTL, Appliance
from tests.test_faults_real import lock_info, main_pid, state_dir
from tests.test_switch_real import long_stream

CTRL_C = b"\x03"


class Terminal:
    """A command on a pseudo-terminal of its own: it is the session's foreground process group,
    so a key typed here reaches it as a person's would."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: exec at once, nothing else of pytest runs here
            try:
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        self.screen = b""
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.returncode: int | None = None

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 4096)
            except OSError:  # EIO: the command exited and the terminal closed
                return
            if not data:
                return
            with self.lock:
                self.screen += data

    def text(self) -> str:
        with self.lock:
            return self.screen.decode(errors="replace")

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.reader.join(timeout=5)
                return self.returncode
            time.sleep(0.05)
        raise AssertionError(f"the command did not exit within {timeout_s:g} s:\n{self.text()}")

    def close(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.fd)


@contextmanager
def on_terminal(app: Appliance, *args: str) -> Iterator[Terminal]:
    env = dict(app.manager.env, TERM="xterm-256color")
    term = Terminal([B70CTL, "--user", "--config", str(app.config), *args], env)
    try:
        yield term
    finally:
        term.close()


def until(done: Callable[[], bool], term: Terminal, timeout_s: float = 600) -> bool:
    """Until `done()`, or False once the command has exited (the phase was missed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        if os.waitpid(term.pid, os.WNOHANG)[0]:
            term.returncode = -1  # reaped here; the test repeats the switch
            return False
        time.sleep(0.003)
    raise AssertionError(f"the switch never reached its phase:\n{term.text()}")


def in_phase(app: Appliance, phase: str) -> Callable[[], bool]:
    """The switch's note says `phase`; for "hold", its hold mark is written (the note moves on
    to the drain within milliseconds, while the mark stays until the switch ends)."""
    if phase == "hold":
        return lambda: (state_dir(app) / "hold.json").exists()
    return lambda: lock_info(app).get("phase") == phase


def on_screen(term: Terminal, word: str) -> Callable[[], bool]:
    return lambda: word in term.text()


def interrupted_on_terminal(app: Appliance, phase: str) -> tuple[int, str, int]:
    """`b70ctl switch` on a terminal, Ctrl-C typed in `phase`: the exit code, the screen and
    the old runtime's main pid. A phase can be over before the key lands (verify takes a
    fraction of a second): then the run is repeated, up to three times."""
    for _ in range(3):
        app.b70ctl("switch", "llamacpp", check=True)
        before = main_pid(app, "b70-llamacpp.service")
        # Hold and drain pass in milliseconds when nothing is in flight: a stream keeps the
        # switch there. Loading is vLLM's: it loads for half a minute here. Verify takes a
        # fraction of a second for either engine: it is the second llama.cpp runtime's.
        stream = long_stream(app, max_tokens=200) if phase in {"hold", "drain"} else None
        args = ("llamacpp", "--restart") if stream is not None else (TARGET[phase],)
        with on_terminal(app, "switch", *args) as term:
            if phase == "loading":
                reached = until(on_screen(term, "loading: b70-vllm.service"), term)
            else:
                reached = until(in_phase(app, phase), term)
            if reached:
                term.type(CTRL_C)
                code = term.wait(600)
            if stream is not None:
                for _ in stream:
                    pass
            last = app.json("status")["result"]["last_switch"] or {}
            if reached and last.get("interrupted"):
                return code, term.text(), before
    pytest.fail(f"the switch never stayed in phase {phase} long enough to be interrupted")


TARGET = {"hold": "llamacpp", "drain": "llamacpp", "loading": "vllm", "verify": "llamacpp-b"}


def enabled_runtimes(status: dict[str, Any]) -> set[str]:
    runtimes = {
        "b70-llamacpp.service",
        "b70-llamacpp-b.service",
        "b70-vllm.service",
        "b70-broken.service",
    }
    return {
        u["unit"] for u in status["units"] if u["unit"] in runtimes and u["enabled"] == "enabled"
    }


@pytest.mark.parametrize("phase", ["hold", "drain", "loading", "verify"])
def test_ctrl_c_typed_on_a_terminal_leaves_one_runtime_serving_and_enabled(
    appliance: Appliance, phase: str
) -> None:
    code, screen, before = interrupted_on_terminal(appliance, phase)
    assert code == 130, screen
    assert "Traceback" not in screen, screen
    assert "interrupted" in screen, screen
    status = appliance.json("status")["result"]
    last = status["last_switch"]
    assert last["interrupted"] is True, last
    serving = status["active_runtime"]
    if phase in {"hold", "drain"}:
        # Before the start: nothing changed, the old runtime serves on, the same process.
        assert "nothing was changed" in screen, screen
        assert last["ok"] is False and last["to"] == "llamacpp", last
        assert serving == "llamacpp"
        assert main_pid(appliance, "b70-llamacpp.service") == before
    else:
        # After the start: the switch was finished, and boot agrees with what serves.
        target = TARGET[phase]
        assert f"the switch was finished: {target} is serving" in screen, screen
        assert last["ok"] is True and last["to"] == target, last
        assert serving == target
    assert enabled_runtimes(status) == {f"b70-{serving}.service"}, status["units"]
    assert status["hold"]["switching_to"] is None
    assert not (state_dir(appliance) / "hold.json").exists()
    assert appliance.ask().strip()
    assert appliance.json("switch", "llamacpp")["ok"]
