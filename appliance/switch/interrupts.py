"""SIGINT and SIGTERM during a switch: collected at safe points, never handled mid-call."""

from __future__ import annotations

import signal
import threading

from appliance.errors import ApplianceError
from appliance.units.serving import Progress

SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def start_blocked(thread: threading.Thread) -> None:
    """Start `thread` with SIGINT and SIGTERM blocked from its first instruction on.

    The kernel hands a process's signal to any thread that does not block it. A Ctrl-C typed
    on a terminal that lands on a helper thread is still acted on by Python in the main thread,
    as a KeyboardInterrupt at whatever line it is on, past the switch's safe points: so every
    thread a command starts blocks both, and only the main thread ever takes them. A thread
    inherits its creator's mask, hence the mask is set around the start rather than inside.
    """
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class SwitchInterrupted(ApplianceError):
    def __init__(self, message: str, recorded: bool = False) -> None:
        super().__init__(message, code="interrupted", exit_code=130)
        self.recorded = recorded  # the switch's record is written already


class Interrupts:
    """SIGINT (Ctrl-C) and SIGTERM during a switch: noted, and acted on at the next safe point.

    Before the target's StartUnit the switch stops there and nothing has changed. From the
    StartUnit on, the old runtime is already stopping: the switch finishes (or rolls back) as if
    nothing had happened, then says it was interrupted. Either way the hold is released and the
    switch is recorded; the command exits 130.

    The signals are blocked for the switch and collected when it looks (`received`), rather than
    handled: a handler would break the D-Bus call it interrupts (sd-bus returns EINTR).
    """

    SIGNALS = SIGNALS

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._received: str | None = None
        self.committed = False  # the StartUnit was sent: finish instead of stopping
        self._blocked = False

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
            self._blocked = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._blocked:
            self._collect()  # taken here, so unblocking does not deliver them
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)

    def _collect(self) -> None:
        while self._blocked and (info := signal.sigtimedwait(self.SIGNALS, 0)) is not None:
            if self._received is None:
                self._received = signal.Signals(info.si_signo).name
                then = "finishing the switch" if self.committed else "stopping at a safe point"
                self.progress("interrupted", f"{self._received}: {then}, then exiting")

    @property
    def received(self) -> str | None:
        """The first SIGINT or SIGTERM that came, by name."""
        self._collect()
        return self._received

    def check(self, phase: str) -> None:
        """Stop here if a signal came and the switch has not committed to the start yet."""
        if self.received and not self.committed:
            raise SwitchInterrupted(
                f"interrupted by {self.received} during {phase}, before the new runtime was "
                "started: nothing was changed",
            )
