"""Whether a runtime fits in GPU memory: may it start now, and would a switch leave it enough?

`judge_start` is what a runtime unit's GPU-memory guard (ExecStartPre) waits for; `judge_switch`
is the switch's preflight. Both are pure functions of a gpu.Snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance import GIB
from appliance.errors import ApplianceError
from appliance.host import gpu

POLL_S = 0.25
APPLIANCE_UNIT_PREFIX = "b70-"


def gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class Verdict:
    """Whether a start fits in the GPU's free memory, and why."""

    ok: bool
    reason: str
    device: str | None = None


def pick_device(snap: gpu.Snapshot, wanted: str) -> gpu.DeviceMemory | None:
    """`auto`: the first B70, else the first xe device, else the first Intel GPU."""
    if wanted != "auto":
        for mem in snap.devices:
            if mem.device.pci_slot == wanted:
                return mem
        raise ApplianceError(
            f"no Intel GPU at PCI address {wanted}",
            hint="`b70ctl gpu` lists the GPUs; fix gpu.device in the config",
            code="gpu_not_found",
        )
    ranked = sorted(snap.devices, key=lambda m: (not m.device.is_b70, m.device.driver != "xe"))
    return ranked[0] if ranked else None


def is_appliance(holder: gpu.Holder) -> bool:
    return bool(holder.unit and holder.unit.startswith(APPLIANCE_UNIT_PREFIX))


def describe_holders(holders: list[tuple[gpu.Holder, int]]) -> str:
    return "; ".join(
        f"pid {h.pid} ({(h.command or '?')[:80]}) in {h.unit or 'no unit'}: {gib(b)}"
        for h, b in holders
    )


def judge_start(snap: gpu.Snapshot, wanted: str, need_bytes: int, unit: str | None) -> Verdict:
    """May `unit` start? Other appliance runtimes must have let go, and enough must be free."""
    mem = pick_device(snap, wanted)
    if mem is None:
        return Verdict(True, "no Intel GPU found: nothing to wait for")
    slot = mem.device.pci_slot
    others = [(h, b) for h, b in mem.holders if is_appliance(h) and h.unit != unit]
    if others:
        return Verdict(False, f"still held by {describe_holders(others)}", slot)
    free = mem.free_bytes
    if free is None:
        return Verdict(
            True, f"{slot}: total memory unknown ({mem.error or mem.source}); not checked", slot
        )
    if free < need_bytes:
        foreign = [(h, b) for h, b in mem.holders if not is_appliance(h)]
        held = f"; held by {describe_holders(foreign)}" if foreign else ""
        return Verdict(
            False,
            f"{slot}: {gib(free)} free of {gib(mem.total_bytes)}, need {gib(need_bytes)}{held}",
            slot,
        )
    return Verdict(
        True, f"{slot}: {gib(free)} free of {gib(mem.total_bytes)}, need {gib(need_bytes)}", slot
    )


def judge_switch(snap: gpu.Snapshot, wanted: str, need_bytes: int, ours: set[int]) -> Verdict:
    """Would the target have enough once every appliance runtime has stopped?

    `ours` are the pids of appliance processes that live outside b70 units (containers).
    """
    mem = pick_device(snap, wanted)
    if mem is None:
        return Verdict(True, "no Intel GPU found: GPU memory not checked")
    slot = mem.device.pci_slot
    if mem.total_bytes is None:
        return Verdict(
            True, f"{slot}: total memory unknown ({mem.error or mem.source}); not checked", slot
        )
    foreign = [(h, b) for h, b in mem.holders if not is_appliance(h) and h.pid not in ours]
    appliance_held = mem.held_bytes - sum(b for _, b in foreign)
    if mem.used_bytes is not None:
        free_after = mem.total_bytes - mem.used_bytes + appliance_held
    else:
        free_after = mem.total_bytes - sum(b for _, b in foreign)
    if free_after >= need_bytes:
        return Verdict(True, f"{slot}: {gib(free_after)} free once the current runtime stops", slot)
    who = describe_holders(foreign) if foreign else "memory not attributed to any process"
    return Verdict(
        False,
        f"{slot}: only {gib(free_after)} of {gib(mem.total_bytes)} would be free for "
        f"{gib(need_bytes)}; outside the appliance: {who}",
        slot,
    )


def judge_start_all(
    snap: gpu.Snapshot, wanted: Sequence[str], need_bytes: int, unit: str | None
) -> Verdict:
    """judge_start on each of a runtime's cards: the first that says no, else all of them."""
    verdicts = [judge_start(snap, w, need_bytes, unit) for w in wanted]
    for verdict in verdicts:
        if not verdict.ok:
            return verdict
    return Verdict(True, "; ".join(dict.fromkeys(v.reason for v in verdicts)), verdicts[0].device)


def wait_start(
    root: Path,
    wanted: Sequence[str],
    need_bytes: int,
    unit: str | None,
    timeout_s: float,
    log: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
) -> Verdict:
    """Poll until judge_start allows the start; raise with the last reason on timeout."""
    start = clock()
    last = ""
    while True:
        verdict = judge_start_all(gpu.snapshot(root), wanted, need_bytes, unit)
        if verdict.ok:
            log(f"GPU memory: {verdict.reason} (after {clock() - start:.1f} s)")
            return verdict
        if verdict.reason != last:
            log(f"GPU memory: waiting: {verdict.reason}")
            last = verdict.reason
        if clock() - start >= timeout_s:
            raise ApplianceError(
                f"GPU memory was not free within {timeout_s:g} s: {verdict.reason}",
                hint="`b70ctl gpu` shows who holds it; stop that process or lower the need",
                code="gpu_memory_busy",
            )
        sleep(poll_s)
