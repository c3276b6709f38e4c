"""The switch records: the last switch, for `status`, and every switch, oldest first, for the
status page, the metrics and what a swap is expected to cost."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config import RuntimeConfig
from appliance.files import write_atomic
from appliance.layout import HISTORY, LAST_SWITCH


def record_switch(state_dir: Path, record: dict[str, Any]) -> str | None:
    """Keep a switch's outcome for `status`; what kept it from being written, or None.

    Never raises: the switch has happened by now, and a full file system must not turn it
    into a failure, nor hide the failure it records."""
    line = json.dumps(record, sort_keys=True)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(state_dir / LAST_SWITCH, line + "\n")
        with open(state_dir / HISTORY, "a") as f:
            f.write(line + "\n")
    except OSError as e:
        why = e.strerror or str(e)
        return f"this switch was not recorded in {state_dir}: {why}; `status` shows the one before"
    return None


def read_history(state_dir: Path) -> list[dict[str, Any]]:
    """Every switch record, oldest first; lines that do not parse are skipped."""
    try:
        lines = (state_dir / HISTORY).read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def last_switch(state_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((state_dir / LAST_SWITCH).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recipe_of(rt: RuntimeConfig) -> str:
    """A short fingerprint of a runtime's table as the config gives it: a switch's record keeps
    it, so that a swap's cost is learnt afresh once `install` changed the recipe."""
    text = json.dumps(dataclasses.asdict(rt), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def swap_costs(
    history: Sequence[Mapping[str, Any]], runtimes: Mapping[str, RuntimeConfig]
) -> tuple[dict[str, float], dict[str, float]]:
    """What each runtime's next swap in is expected to take, from the records (`swap_figures`:
    the warm figure where its lasting cache is warm, else the last), and when each runtime's
    last switch in ended (epoch seconds). A failed start is no cost."""
    figures, since = swap_figures(history, runtimes)
    return {name: f.expected for name, f in figures.items()}, since


@dataclass(frozen=True)
class SwapFigures:
    """What a runtime's swaps in took with its present recipe: the last of all, the last cold
    and the last warm one (appliance.engines.lasting), and whether the next finds its cache warm:
    a start kept what it compiled unless its cache could not be used."""

    last: float
    cold: float | None = None
    warm: float | None = None
    next_warm: bool | None = None  # None: the last start on record did not say

    @property
    def expected(self) -> float:
        if self.next_warm and self.warm is not None:
            return self.warm
        return self.last


def swap_figures(
    history: Sequence[Mapping[str, Any]], runtimes: Mapping[str, RuntimeConfig]
) -> tuple[dict[str, SwapFigures], dict[str, float]]:
    """Each runtime's swap figures, from its switch time less the drain of what the other
    runtime still served, over the switches to it that succeeded with its present recipe (a
    record without one is from before recipes were kept and counts); and when each runtime's
    last switch in ended (epoch seconds)."""
    figures: dict[str, SwapFigures] = {}
    since: dict[str, float] = {}
    recipes = {name: recipe_of(rt) for name, rt in runtimes.items()}
    for record in history:
        to, seconds, at = record.get("to"), record.get("seconds"), record.get("at")
        if not (record.get("ok") and isinstance(to, str) and isinstance(seconds, int | float)):
            continue
        if isinstance(at, int | float):
            since[to] = float(at)
        recipe = record.get("recipe")
        if recipe is not None and recipe != recipes.get(to):
            continue
        phases = record.get("phases")
        drained = phases.get("drained") if isinstance(phases, dict) else None
        cost = float(seconds)
        if isinstance(drained, int | float) and 0 <= drained <= cost:
            cost -= float(drained)
        before = figures.get(to, SwapFigures(cost))
        start = record.get("start")
        verdict = start.get("verdict") if isinstance(start, dict) else None
        cause = str(start.get("cause") or "") if isinstance(start, dict) else ""
        figures[to] = SwapFigures(
            last=cost,
            cold=cost if verdict == "cold" else before.cold,
            warm=cost if verdict == "warm" else before.warm,
            # a start whose cache could not be used kept nothing (the guard's cause)
            next_warm=None
            if verdict is None
            else verdict in ("warm", "cold") and not cause.startswith("the cache "),
        )
    return figures, since
