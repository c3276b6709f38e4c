"""Live progress of a switch on a terminal: the current phase with its elapsed time, the card's
VRAM as it is freed and filled, and the runtime's own last journal line while it loads.

One line is redrawn in place (carriage return, erase line) five times a second; each phase that
ends is left above it with the time it took. On a pipe, or with --json, b70ctl prints plain
lines instead (appliance.cli.output.progress).
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from appliance import GIB
from appliance.switch.interrupts import start_blocked

if TYPE_CHECKING:
    from appliance.layout import Scope

REDRAW_S = 0.2
LOOK_S = 1.0  # how often the VRAM and the journal are read again
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
UNIT = re.compile(r"b70-[a-z0-9-]+\.service")


def vram_now() -> str | None:
    """`0000:03:00.0 4.1/32.0 GiB` for each Intel card, or None without one."""
    from appliance.host import gpu

    snap = gpu.snapshot(gpu.sysroot())
    parts = []
    for mem in snap.devices:
        total = f"{mem.total_bytes / GIB:.1f}" if mem.total_bytes else "?"
        parts.append(f"{mem.device.pci_slot} {mem.in_use_bytes / GIB:.1f}/{total} GiB")
    return ", ".join(parts) or None


class Live:
    """A progress callback (phase, detail) that draws on a terminal; close() when done."""

    def __init__(
        self,
        stream: TextIO,
        journal_tail: Callable[[str], str | None],
        vram: Callable[[], str | None] = vram_now,
        clock: Callable[[], float] = time.monotonic,
        width: Callable[[], int] = lambda: shutil.get_terminal_size().columns,
        redraw_s: float = REDRAW_S,
        look_s: float = LOOK_S,
    ) -> None:
        self.stream, self.journal_tail, self.vram = stream, journal_tail, vram
        self.clock, self.width = clock, width
        self.redraw_s, self.look_s = redraw_s, look_s
        self.phase: str | None = None
        self.detail = ""
        self.began = clock()
        self.unit: str | None = None
        self.seen: dict[str, str | None] = {"vram": None, "journal": None}
        self.looked = 0.0
        self.frame = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="live-progress", daemon=True)
        start_blocked(self.thread)  # a Ctrl-C must reach the switch's main thread alone

    def __call__(self, phase: str, detail: str) -> None:
        with self.lock:
            self._finish_phase()
            self.phase, self.detail, self.began = phase, detail, self.clock()
            if match := UNIT.search(detail):
                self.unit = match.group()
            self.seen["journal"] = None
            self._draw()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2)
        with self.lock:
            self._finish_phase()
            self.phase = None

    def _finish_phase(self) -> None:
        if self.phase is not None:
            took = self.clock() - self.began
            self._write(f"\r\033[K  {self.phase}: {self.detail} ({took:.1f} s)\n")

    def _run(self) -> None:
        while not self.stopped.wait(self.redraw_s):
            self._look()
            with self.lock:
                self._draw()

    def _look(self) -> None:
        """Read the VRAM and the unit's journal again, at most every LOOK_S (outside the lock:
        both take a moment)."""
        now = self.clock()
        if now - self.looked < self.look_s:
            return
        self.looked = now
        try:
            vram = self.vram()
        except OSError:
            vram = None
        journal = self.journal_tail(self.unit) if self.unit and self.phase == "loading" else None
        with self.lock:
            self.seen["vram"] = vram
            self.seen["journal"] = journal

    def _draw(self) -> None:
        if self.phase is None:
            return
        self.frame += 1
        spin = SPINNER[self.frame % len(SPINNER)]
        parts = [f"{spin} {self.phase}: {self.detail} {self.clock() - self.began:5.1f} s"]
        if self.seen["vram"]:
            parts.append(f"VRAM {self.seen['vram']}")
        if self.seen["journal"]:
            parts.append(self.seen["journal"])
        line = "  ·  ".join(parts)
        room = max(self.width() - 1, 20)
        if len(line) > room:
            line = line[: room - 1] + "…"
        self._write(f"\r\033[K{line}")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def journal_tail(scope: Scope) -> Callable[[str], str | None]:
    """The last line a unit wrote to the journal, without its prefix."""
    from appliance import run
    from appliance.units import systemd

    def tail(unit: str) -> str | None:
        argv = [*systemd.journal_command(scope, unit, 1), "--output=cat"]
        out = run.ask(argv, 2)
        if out is None or out.returncode != 0:
            return None
        lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        return lines[-1] if lines and not lines[-1].startswith("-- ") else None

    return tail
