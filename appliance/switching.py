"""The switch: preflight, one StartUnit, verify through the proxy, record, or roll back."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import gpu, health, plans, run, runtimes, state, systemd
from appliance.config import Config, Engine, Launcher, RuntimeConfig
from appliance.errors import ApplianceError
from appliance.gpu import memgate
from appliance.layout import PROXY_CONFIG, PROXY_UNIT, Layout, Scope, layout
from appliance.proxy import hold as hold_mark
from appliance.render import render_all
from appliance.state import read_key
from appliance.units import (
    SUB_STATE_PHASE,
    Progress,
    check_port,
    no_progress,
    serving_runtime,
    wait_started,
    wait_stopped,
)

POLL_S = 0.1
DRAIN_POLL_S = 0.2
# A request the proxy let through just before the hold was marked reaches the runtime a few
# milliseconds later: the drain counts only after this, and only two empty readings in a row.
DRAIN_SETTLE_S = 0.3
VERIFY_PROMPT = "Reply with one word: ready"


# --- switch ------------------------------------------------------------------------------------


def preflight(config: Config, lay: Layout, sd: systemd.Systemd, target: RuntimeConfig) -> list[str]:
    """Check the target without touching anything. Returns notes; raises on the first problem."""
    notes = []
    files = render_all(config, lay)
    for name in (target.unit, PROXY_UNIT, PROXY_CONFIG):
        dest = lay.destination(name)
        try:
            current = dest.read_text()
        except FileNotFoundError:
            raise _preflight(f"{dest} is not installed", "run `b70ctl install`") from None
        if current != files[name]:
            raise _preflight(
                f"{dest} differs from what {config.path} renders",
                "run `b70ctl render --diff` to see how, then `b70ctl install`",
            )
    if sd.state(target.unit).load_state != "loaded":
        raise _preflight(f"systemd has not loaded {target.unit}", "run `b70ctl install`")
    check_runtime_files(config, target)
    check_port(sd, [rt.unit for rt in config.runtimes.values()], config.backend.port, "backend")
    if sd.state(PROXY_UNIT).active_state != "active":
        raise _preflight(
            f"the proxy {PROXY_UNIT} is not active, so no switch could be verified",
            f"start it: {systemd.systemctl_command(lay.scope)} start {PROXY_UNIT}",
        )
    snap = gpu.snapshot(gpu.sysroot())
    need = target.memory_needed_bytes
    verdict = memgate.judge_switch(snap, config.gpu.device, need, container_pids(config))
    if not verdict.ok:
        raise ApplianceError(
            f"{target.name} would not have enough GPU memory: {verdict.reason}",
            hint="stop that process first; `b70ctl gpu` shows every holder",
            code="gpu_memory_busy",
        )
    notes.append(f"GPU memory: {verdict.reason}")
    return notes


def container_pids(config: Config) -> set[int]:
    """Processes of the appliance's containers: they live outside the b70 units' cgroups."""
    pids: set[int] = set()
    for rt in config.runtimes.values():
        if rt.launcher is not Launcher.NATIVE:
            cli = runtimes.container_cli(config, rt)
            pid = health.container_pid(cli, runtimes.container_name(rt))
            if pid:
                pids |= health.process_tree(pid)
    return pids


def _preflight(message: str, hint: str) -> ApplianceError:
    return ApplianceError(message, hint=hint, code="preflight_failed")


def check_runtime_files(config: Config, rt: RuntimeConfig) -> None:
    where = f"runtimes.{rt.name}"
    if rt.launcher is Launcher.NATIVE:
        exe = rt.command[0]
        found = exe if os.path.isabs(exe) else shutil.which(exe)
        if not found or not os.access(found, os.X_OK):
            raise _preflight(
                f"{where}.command: {exe} is not an executable file", "install it or fix the path"
            )
        for key, path in (("model", rt.model), ("mmproj", rt.mmproj)):
            if (
                path
                and (os.path.isabs(path) or rt.engine is Engine.LLAMACPP)
                and not os.path.exists(path)
            ):
                raise _preflight(
                    f"{where}.{key}: {path} does not exist", "download it or fix the path"
                )
    else:
        cli = runtimes.container_cli(config, rt)
        out = run.run(
            [cli, "image", "inspect", rt.image or ""],
            timeout_s=30,
            hint=f"install {rt.launcher}, or check that its daemon answers",
            code="preflight_failed",
        )
        if out.returncode != 0:
            raise _preflight(
                f"{where}.image: {rt.image} is not present in {rt.launcher}",
                f"pull it first: {cli} pull {rt.image}",
            )


@dataclass
class SwitchResult:
    target: str
    previous: str | None
    ok: bool
    seconds: float
    phases: dict[str, float]
    notes: list[str]
    answer: str | None = None
    rolled_back: bool = False
    error: str | None = None
    journal: str | None = None

    def record(self) -> dict[str, Any]:
        return {
            "at": time.time(),
            "from": self.previous,
            "to": self.target,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            "rolled_back": self.rolled_back,
            "error": self.error,
        }


def verify_through_proxy(
    config: Config, lay: Layout, token: str | None = None, timeout_s: float = 60
) -> str:
    """A real completion on the proxy port; retried briefly while the proxy reconnects.

    `token` is the hold mark's: the switch's own request passes the hold it set.
    """
    key = read_key(lay)
    headers = {hold_mark.BYPASS_HEADER: token} if token else {}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return health.chat_completion(
                runtimes.proxy_url(config), key, config.proxy.model, VERIFY_PROMPT, headers=headers
            )
        except ApplianceError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def start_unit(
    config: Config, sd: systemd.Systemd, rt: RuntimeConfig, progress: Progress
) -> dict[str, float]:
    """One StartUnit: Conflicts= stops the old runtime in the same transaction. Waits until the
    unit is active (its health gate passed); the seconds spent in each phase."""
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    if sd.state(rt.unit).sub_state == "auto-restart":  # a crash loop: end it, then start afresh
        sd.stop(rt.unit)
        wait_stopped(sd, rt.unit, runtimes.stop_timeouts(rt).unit_s + 30)
    sd.reset_failed(rt.unit)  # a manual switch is not a crash loop: clear the start limit
    sd.start(rt.unit)
    others = [o for o in config.runtimes.values() if o.name != rt.name]
    stop_budget = sum(runtimes.stop_timeouts(o).unit_s for o in others) + 30
    for sub, seconds in wait_started(
        sd, rt.unit, rt.start_timeout_s + stop_budget, progress
    ).items():
        timings[SUB_STATE_PHASE.get(sub, sub)] = seconds
    timings["unit"] = time.monotonic() - t0
    return timings


def verify_runtime(
    config: Config, lay: Layout, rt: RuntimeConfig, progress: Progress, token: str | None
) -> tuple[float, str]:
    """A real completion through the proxy's port; the seconds it took, and the answer."""
    t0 = time.monotonic()
    progress("verifying", f"a completion through port {config.proxy.port}")
    answer = verify_through_proxy(config, lay, token)
    progress("verified", f"{rt.name} answers through port {config.proxy.port}")
    return time.monotonic() - t0, answer


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

    SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})

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


def drain(
    config: Config,
    timeout_s: float,
    progress: Progress,
    stop: Callable[[], bool] = lambda: False,
) -> tuple[float, int | None]:
    """Wait until the serving runtime has no request running or queued, up to `timeout_s`.

    Returns the seconds waited and what was still in flight at the end: 0 when drained, more
    when the time ran out, None when the runtime's metrics could not be read.
    """
    t0 = time.monotonic()
    time.sleep(DRAIN_SETTLE_S)
    url, empty, shown = runtimes.backend_url(config), 0, None
    while True:
        n = health.read_in_flight(url)
        if n is None or (n == 0 and empty >= 1) or stop():
            return time.monotonic() - t0, n
        empty = empty + 1 if n == 0 else 0
        if n and n != shown:
            progress("draining", f"{n} request{'s' if n > 1 else ''} in flight")
            shown = n
        if n and time.monotonic() - t0 >= timeout_s:
            return time.monotonic() - t0, n
        time.sleep(DRAIN_POLL_S)


def switch(
    config: Config,
    scope: Scope,
    target_name: str,
    restart: bool = False,
    progress: Progress = no_progress,
    gate: bool = False,
    drain_s: float | None = None,
) -> SwitchResult:
    """The switch of DESIGN.md, numbered as there:

    1. lock; 2. preflight; 3. hold new requests at the proxy; 4. drain the old runtime;
    5. one StartUnit (Conflicts= stops the old one); 6. verify through the proxy (and gate);
    7. release the hold, enable the target, record. A failure in 5 or 6 rolls back, still held.

    What to do is decided by appliance.plans.plan_switch from what was observed; this applies it.
    """
    lay = layout(scope)
    target = config.runtime(target_name)
    t0 = time.monotonic()
    with (
        state.switch_lock(lay.state_dir, target_name) as lock,
        systemd.connect(scope) as sd,
        Interrupts(progress) as interrupts,
    ):
        if lock.stale is not None:
            recover_killed(config, lay, sd, lock.stale, progress, wait=True)
        notes = preflight(config, lay, sd, target)
        run = _Run(config, lay, sd, target, serving_runtime(config, sd), lock, interrupts, t0)
        run.notes += notes
        run.phases["preflight"] = time.monotonic() - t0
        drain_for = config.proxy.drain_s if drain_s is None else drain_s
        plan = plans.plan_switch(
            plans.Observed(run.previous), target_name, plans.Options(restart, gate, drain_for)
        )
        if plan.already:
            run.apply(plan.steps)
            run.notes.append(f"{target_name} is already serving")
            return run.result(ok=True)
        try:
            interrupts.check("preflight")
            return run.switch(plan)
        except SwitchInterrupted as e:
            if e.recorded:
                raise
            result = run.result(ok=False, error=e.message)
            unrecorded = state.record_switch(
                lay.state_dir, {**result.record(), "interrupted": True}
            )
            if unrecorded:
                e.message += f"; {unrecorded}"
            raise


@contextmanager
def holding(state_dir: Path, target: str) -> Iterator[hold_mark.Mark]:
    """New requests held at the proxy for the block; a mark that cannot be written (a full
    file system) is refused here, before anything has changed."""
    with ExitStack() as stack:
        try:
            mark = stack.enter_context(hold_mark.marked(state_dir, target))
        except hold_mark.Unwritable as e:
            raise ApplianceError(
                f"cannot write the hold mark {e.path}: {e.why}; nothing was changed",
                hint=f"free space on the file system of {state_dir} (df -h {state_dir}), "
                "or fix its permissions; then switch again",
                code="state_unwritable",
            ) from None
        yield mark


class _Run:
    """One switch, applying the steps of its plan through systemd, the proxy and the state
    directory; it keeps what the record needs (phases, notes, the answer)."""

    def __init__(
        self,
        config: Config,
        lay: Layout,
        sd: systemd.Systemd,
        target: RuntimeConfig,
        previous: str | None,
        lock: state.SwitchLock,
        interrupts: Interrupts,
        t0: float,
    ) -> None:
        self.config, self.lay, self.sd, self.target = config, lay, sd, target
        self.previous, self.lock, self.interrupts, self.t0 = previous, lock, interrupts, t0
        self.progress = interrupts.progress
        self.phases: dict[str, float] = {}
        self.notes: list[str] = []
        self.answer: str | None = None
        self.token: str | None = None  # the hold mark's: the switch's own requests pass it
        self.started_at: float | None = None  # the failed start's journal begins here
        self.hold = ExitStack()
        self.current: plans.Step | None = None  # the step being applied

    def result(self, ok: bool, **fields: Any) -> SwitchResult:
        return SwitchResult(
            self.target.name,
            self.previous,
            ok,
            time.monotonic() - self.t0,
            self.phases,
            self.notes,
            self.answer,
            **fields,
        )

    def switch(self, plan: plans.Plan) -> SwitchResult:
        """Steps 3-7: the plan's steps, and its rollback if a start, verify or gate fails."""
        with self.hold:
            try:
                self.apply(plan.steps)
            except ApplianceError as failure:
                if self.current is None or self.current.kind not in plans.ROLLED_BACK:
                    raise  # before the commit nothing changed; a stop that hangs is its own error
                return self.roll_back(plan, failure)
        received = self.interrupts.received
        unrecorded = state.record_switch(
            self.lay.state_dir,
            {**self.result(ok=True).record(), "interrupted": received is not None},
        )
        if unrecorded:
            self.notes.append(unrecorded)
        if received:
            raise SwitchInterrupted(
                f"interrupted by {received} after {self.target.name} had begun to start; the "
                f"switch was finished: {self.target.name} is serving",
                recorded=True,
            )
        return self.result(ok=True)

    def apply(self, steps: tuple[plans.Step, ...], rolling_back: bool = False) -> None:
        for step in steps:
            self.current = step
            self.step(step, rolling_back)

    def step(self, step: plans.Step, rolling_back: bool = False) -> None:
        config, sd, progress = self.config, self.sd, self.progress
        rt = config.runtime(step.runtime) if step.runtime else self.target
        if step.kind == plans.HOLD:
            self.token = self.hold.enter_context(holding(self.lay.state_dir, rt.name)).token
            self.lock.note(previous=self.previous, phase="hold")
            progress("holding", f"new requests wait at port {config.proxy.port}")
        elif step.kind == plans.DRAIN:
            self.lock.note(phase="drain")
            timeout = step.seconds if step.seconds is not None else config.proxy.drain_s
            stop = lambda: self.interrupts.received is not None  # noqa: E731
            self.phases["drained"], left = drain(config, timeout, progress, stop)
            self.interrupts.check("the drain")
            if left:
                self.notes.append(
                    f"drain: {left} request(s) still in flight after {timeout:g} s; "
                    f"{rt.name} was given its stop timeout to finish them"
                )
            elif left is None:
                self.notes.append(f"drain: {rt.name} did not report its requests in flight")
        elif step.kind == plans.COMMIT:
            self.interrupts.check("the drain")
            self.interrupts.committed = True
            self.lock.note(phase="start")
        elif step.kind == plans.STOP:
            progress("stopping", rt.unit)
            sd.stop(rt.unit)
            if not rolling_back:
                wait_stopped(sd, rt.unit, runtimes.stop_timeouts(rt).unit_s + 30)
        elif step.kind == plans.START:
            if rolling_back:
                progress("rolling back", f"starting {rt.name} again")
            elif self.started_at is None:
                self.started_at = time.time()
            timings = start_unit(config, sd, rt, progress)
            if not rolling_back:
                self.phases.update(timings)
        elif step.kind == plans.VERIFY:
            if not rolling_back and self.token is not None:
                self.lock.note(phase="verify")
            took, answer = verify_runtime(config, self.lay, rt, progress, self.token)
            if not rolling_back:
                self.phases["verified"], self.answer = took, answer
        elif step.kind == plans.GATE:
            self.lock.note(phase="gate")
            t_gate = time.monotonic()
            progress("gating", "JSON mode and canaries")
            run_gate(config, self.lay, rt.name, token=self.token)
            self.phases["gated"] = time.monotonic() - t_gate
        elif step.kind == plans.ENABLE:
            self.hold.close()  # the held requests go on now; the rest is bookkeeping
            enable_only(config, sd, rt.name)
        else:  # pragma: no cover - a plan names only the steps above
            raise AssertionError(f"unknown step {step}")

    def roll_back(self, plan: plans.Plan, failure: ApplianceError) -> SwitchResult:
        """The plan's rollback, still held; then the error, recorded."""
        self.lock.note(phase="rollback")
        target = self.target
        journal = systemd.journal_excerpt(self.lay.scope, target.unit, since=self.started_at)
        reason = f"switch to {target.name} failed: {failure.message}"
        if journal:
            tail = "\n".join("    " + line for line in journal.splitlines()[-12:])
            reason += f"\n  last lines of {target.unit}:\n{tail}"
        rolled_back = False
        try:
            self.apply(plan.rollback, rolling_back=True)
        except ApplianceError as second:
            reason += f"\n  rolling back to {self.previous} failed as well: {second.message}"
        else:
            if self.previous is None:
                reason += "\n  no runtime was serving before, so none is serving now"
            else:
                rolled_back = True
                reason += f"\n  rolled back: {self.previous} is serving again"
        result = self.result(ok=False, rolled_back=rolled_back, error=reason, journal=journal)
        self.hold.close()
        unrecorded = state.record_switch(
            self.lay.state_dir,
            {**result.record(), "interrupted": self.interrupts.received is not None},
        )
        raise ApplianceError(
            reason + (f"\n{unrecorded}" if unrecorded else ""),
            hint=f"journal: {' '.join(systemd.journal_command(self.lay.scope, target.unit, 50))}",
            code="switch_failed",
            details={"switch": result.record(), "journal": journal},
        ) from failure


def enable_only(config: Config, sd: systemd.Systemd, name: str) -> None:
    """Make runtime `name` the one that starts at boot, and no other."""
    sd.disable([rt.unit for rt in config.runtimes.values() if rt.name != name])
    sd.enable([config.runtime(name).unit])


def recover_killed(
    config: Config,
    lay: Layout,
    sd: systemd.Systemd,
    trace: dict[str, Any],
    progress: Progress,
    wait: bool,
) -> str | None:
    """After a switch that was killed (no cleanup ran): record it, and leave one runtime serving
    that is also the one enabled at boot. Returns what was done, or None while systemd is still
    finishing a job the killed switch started (then the trace stays for the next command).

    1. A runtime unit still has a job pending: with `wait`, wait for it; else come back later.
    2. One runtime serves: it becomes the one enabled at boot.
    3. None serves: the one enabled at boot is started (the default runtime if none is).
    """
    units = {name: rt.unit for name, rt in config.runtimes.items()}
    for rt in config.runtimes.values():
        if not sd.state(rt.unit).job_pending:
            continue
        if not wait:
            return None
        progress("recovering", f"waiting for systemd to finish its job on {rt.unit}")
        _wait_settled(sd, rt.unit, rt.start_timeout_s + runtimes.stop_timeouts(rt).unit_s + 30)
    serving = serving_runtime(config, sd)
    if serving is not None:
        done = f"{serving} is serving; it is now the runtime enabled at boot"
        enable_only(config, sd, serving)
    else:
        enabled = [n for n, u in sorted(units.items()) if sd.state(u).unit_file_state == "enabled"]
        name = enabled[0] if enabled else config.default_runtime
        rt = config.runtime(name)
        progress("recovering", f"no runtime is serving: starting {rt.unit}")
        sd.reset_failed(rt.unit)
        sd.start(rt.unit)
        enable_only(config, sd, name)
        done = f"no runtime was serving; started {name}, the runtime enabled at boot"
        if wait:
            try:
                wait_started(sd, rt.unit, rt.start_timeout_s + 60, progress)
            except ApplianceError as e:
                done += f", which failed: {e.message}"
    (lay.state_dir / hold_mark.HOLD_FILE).unlink(missing_ok=True)
    pid, phase = trace.get("pid"), trace.get("phase")
    error = f"b70ctl switch (pid {pid}) was killed during {phase or 'its start-up'}; {done}"
    record: dict[str, Any] = {
        "at": time.time(),
        "from": trace.get("previous"),
        "to": trace.get("target"),
        "ok": False,
        "seconds": round(time.time() - float(trace.get("started_at") or time.time()), 3),
        "phases": {},
        "rolled_back": False,
        "interrupted": True,
        "error": error,
    }
    unrecorded = state.record_switch(lay.state_dir, record)
    progress("recovered", error + (f" ({unrecorded})" if unrecorded else ""))
    return done


def _wait_settled(sd: systemd.Systemd, unit: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while sd.state(unit).job_pending and time.monotonic() < deadline:
        time.sleep(POLL_S)


def run_gate(
    config: Config, lay: Layout, runtime: str, record: bool = False, token: str | None = None
) -> Any:
    """The validity gates through the proxy; raises ApplianceError naming what failed."""
    from appliance.gate import run_gate as gate_checks

    result = gate_checks(
        runtimes.proxy_url(config),
        read_key(lay),
        config.proxy.model,
        runtime,
        lay.state_dir,
        record=record,
        headers={hold_mark.BYPASS_HEADER: token} if token else None,
    )
    if not result.ok:
        raise ApplianceError(
            f"{runtime} failed the validity gates: {result.failures()}",
            hint="`b70ctl gate --json` shows every check; `--record` records canaries anew",
            code="gate_failed",
            details={"checks": [vars(c) for c in result.checks]},
        )
    return result
