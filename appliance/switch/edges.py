"""What a switch does to the world: systemd, the proxy's hold and open count, the state
directory. appliance.switch.apply decides nothing here; it calls these in the order of its plan."""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from appliance import engines
from appliance import hold as hold_mark
from appliance.config import Config, RuntimeConfig
from appliance.engines import lasting
from appliance.errors import ApplianceError
from appliance.host.placement import excludes
from appliance.keys import read_key
from appliance.layout import Layout
from appliance.switch.interrupts import start_blocked
from appliance.switch.lock import SwitchLock
from appliance.switch.records import recipe_of, record_switch
from appliance.units import runtimes, systemd
from appliance.units.render import recipe_folder
from appliance.units.serving import Progress, enable_only, wait_started, wait_stopped

DRAIN_POLL_S = 0.02
# Without the proxy's open count (a proxy that cannot write it), the drain reads the runtime's
# own metrics: a request the proxy let through just before the hold was marked reaches the
# runtime a few milliseconds later, so it counts only after this, and two empty readings.
METRICS_SETTLE_S = 0.3
METRICS_POLL_S = 0.2
VERIFY_PROMPT = "Reply with one word: ready"
VERIFY_RETRY_S = 0.25


@contextmanager
def holding(
    state_dir: Path, target: str, ports: tuple[int, ...] | None = None
) -> Iterator[hold_mark.Mark]:
    """New requests to `ports` held at the proxy for the block; a mark that cannot be written
    (a full file system) is refused here, before anything has changed."""
    with ExitStack() as stack:
        try:
            mark = stack.enter_context(hold_mark.marked(state_dir, target, ports))
        except hold_mark.Unwritable as e:
            raise ApplianceError(
                f"cannot write the hold mark {e.path}: {e.why}; nothing was changed",
                hint=f"free space on the file system of {state_dir} (df -h {state_dir}), "
                "or fix its permissions; then switch again",
                code="state_unwritable",
            ) from None
        yield mark


def verify_through_proxy(
    config: Config,
    lay: Layout,
    token: str | None = None,
    timeout_s: float = 60,
    model: str | None = None,
) -> str:
    """A real completion on the proxy port, for `model` (default [proxy] model); retried
    briefly while the proxy reconnects.

    `token` is the hold mark's: the switch's own request passes the hold it set.
    """
    from appliance.host import health

    key = read_key(lay)
    headers = {hold_mark.BYPASS_HEADER: token} if token else {}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return health.chat_completion(
                runtimes.proxy_url(config),
                key,
                model or config.proxy.model,
                VERIFY_PROMPT,
                headers=headers,
            )
        except ApplianceError:
            if time.monotonic() > deadline:
                raise
            time.sleep(VERIFY_RETRY_S)


def _import_quietly(module: str) -> None:
    """Import ahead of need; a failure is left to the import where the module is used, which
    reports it as any other error (a thread's own would print a traceback)."""
    with contextlib.suppress(Exception):
        importlib.import_module(module)


START_LINES = 2000  # a start's journal, read for what it found in its cache
JOURNAL_SETTLE_S = 0.3  # between two reads of a failed start's journal
JOURNAL_SETTLE_TRIES = 6


class SystemEdges:
    """The edges of appliance.switch.executor.Edges: systemd, the proxy and the state dir."""

    def __init__(
        self,
        config: Config,
        lay: Layout,
        sd: systemd.Systemd,
        lock: SwitchLock,
        progress: Progress,
    ) -> None:
        self.config, self.lay, self.sd, self.lock, self.progress = config, lay, sd, lock, progress

    def hold(self, target: str, stopping: tuple[str, ...]) -> Any:
        """Requests to the target's port and to the ports of the runtimes it stops wait."""
        names = (target, *stopping)
        return holding(self.lay.state_dir, target, self.ports(*names))

    def ports(self, *names: str) -> tuple[int, ...]:
        return tuple(sorted({self.config.runtime(name).port for name in names}))

    def note(self, **fields: Any) -> None:
        self.lock.note(**fields)

    def drain(self, runtime: str, timeout_s: float, stop: Callable[[], bool]) -> int | None:
        """Wait until the requests the proxy let through to `runtime` have all been answered,
        up to `timeout_s`. What was still open at the end: 0 when drained, more when the time
        ran out, None when neither the proxy nor the runtime said."""
        t0, shown = time.monotonic(), None
        rt = self.config.runtime(runtime)
        while True:
            n = hold_mark.read_open(self.lay.state_dir, rt.port)
            if n is None:
                return self.drain_by_metrics(rt, timeout_s, stop)
            if n == 0 or stop():
                return n
            if n != shown:
                self.progress("draining", f"{n} request{'s' if n > 1 else ''} in flight")
                shown = n
            if time.monotonic() - t0 >= timeout_s:
                return n
            time.sleep(DRAIN_POLL_S)

    def drain_by_metrics(
        self, rt: RuntimeConfig, timeout_s: float, stop: Callable[[], bool]
    ) -> int | None:
        """The drain by the runtime's own count of requests running and waiting."""
        from appliance.host import health

        t0 = time.monotonic()
        time.sleep(METRICS_SETTLE_S)
        url, empty, shown = runtimes.backend_url(self.config, rt), 0, None
        while True:
            n = health.read_in_flight(url)
            if n is None or (n == 0 and empty >= 1) or stop():
                return n
            empty = empty + 1 if n == 0 else 0
            if n and n != shown:
                self.progress("draining", f"{n} request{'s' if n > 1 else ''} in flight")
                shown = n
            if n and time.monotonic() - t0 >= timeout_s:
                return n
            time.sleep(METRICS_POLL_S)

    def stop(self, runtime: str, wait: bool) -> None:
        rt = self.config.runtime(runtime)
        self.progress("stopping", rt.unit)
        self.sd.stop(rt.unit)
        if wait:
            wait_stopped(self.sd, rt.unit, runtimes.stop_timeouts(rt).unit_s + 30)

    def start(self, runtime: str) -> dict[str, float]:
        """One StartUnit: Conflicts= stops the old runtime in the same transaction. Waits until
        the unit is active (its health guard passed); the seconds spent in each sub-state."""
        config, sd = self.config, self.sd
        rt = config.runtime(runtime)
        if sd.sub_state(rt.unit) == "auto-restart":  # a crash loop: end it, start afresh
            sd.stop(rt.unit)
            wait_stopped(sd, rt.unit, runtimes.stop_timeouts(rt).unit_s + 30)
        sd.reset_failed(rt.unit)  # a manual switch is not a crash loop: clear the start limit
        sd.start(rt.unit)
        # What the verification needs (http.client; docs/startup.md) is imported while
        # systemd stops the old runtime and starts this one, not after.
        start_blocked(threading.Thread(target=_import_quietly, args=("appliance.host.health",)))
        others = [o for o in config.runtimes.values() if o.name != rt.name and excludes(o, rt)]
        stop_budget = sum(runtimes.stop_timeouts(o).unit_s for o in others) + 30
        return wait_started(sd, rt.unit, rt.start_timeout_s + stop_budget, self.progress)

    def verify(self, runtime: str, token: str | None) -> str:
        model = self.config.runtime(runtime).served_model_name
        return verify_through_proxy(self.config, self.lay, token, model=model)

    def gate(self, runtime: str, token: str | None) -> None:
        from appliance.measure import gate  # httpx: imported only when a switch runs the gates

        gate.require(gate.through_proxy(self.config, self.lay, runtime, token=token))

    def enable(self, runtime: str) -> None:
        enable_only(self.config, self.sd, runtime)

    def journal(self, runtime: str, since: float | None) -> str | None:
        """The failed start's journal, once journald has all of it: a process that exits at
        once may reach the journal after its unit's ExecStartPost= has (journald reads each
        process's stream in its own time), so it is read again until it stops growing."""
        unit = self.config.runtime(runtime).unit
        text = systemd.journal_excerpt(self.lay.scope, unit, since=since)
        for _ in range(JOURNAL_SETTLE_TRIES):
            time.sleep(JOURNAL_SETTLE_S)
            again = systemd.journal_excerpt(self.lay.scope, unit, since=since)
            if again == text:
                break
            text = again
        return text

    def start_cache(self, runtime: str, since: float | None) -> dict[str, Any] | None:
        """What the start's own lines (the cache guard's, then the engine's) say of its lasting
        cache: warm or cold, and why."""
        rt = self.config.runtime(runtime)
        with contextlib.suppress(ApplianceError):  # cards that cannot be placed: not marked
            lasting.mark_started(recipe_folder(self.config, self.lay, rt))  # it started: kept
        text = systemd.journal_excerpt(self.lay.scope, rt.unit, lines=START_LINES, since=since)
        facts = engines.of(rt.engine)
        found = lasting.judge_start(text, facts, facts.compiles(rt.args))
        if found is None:
            return None
        out = {"verdict": found.verdict, "cause": found.cause or None}
        return {**out, "init_s": found.init_s, "compile_s": found.compile_s}

    def journal_command(self, runtime: str) -> str:
        unit = self.config.runtime(runtime).unit
        return " ".join(systemd.journal_command(self.lay.scope, unit, 50))

    def record(self, record: dict[str, Any]) -> str | None:
        rt = self.config.runtimes.get(str(record.get("to")))
        if rt is not None:
            record = {**record, "recipe": recipe_of(rt)}
        return record_switch(self.lay.state_dir, record)
