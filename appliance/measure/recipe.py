"""The plan of a vLLM runtime of the appliance's config: its model's config.json, found where vLLM
would read it, and its own args and env; and whether it can hold one request of its max model
length, which `switch` (and a start on demand) checks before anything is touched, `install`
warns of and `doctor` fails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config import Config, Engine, RuntimeConfig
from appliance.errors import ApplianceError
from appliance.host.doctor import Check
from appliance.measure import serveflags


def names_a_file(target: str) -> bool:
    return target.endswith(".json") or os.sep in target or Path(target).is_file()


def find_model_config(rt: RuntimeConfig) -> Path | None:
    """The config.json vLLM reads for the runtime's model: in the folder it names, or in the
    newest snapshot of the Hugging Face cache the runtime uses (appliance.host.doctor.hf_hub)."""
    from appliance.host.doctor import hf_hub

    model = rt.model
    if os.path.isabs(model):
        found = Path(model) / "config.json"
        return found if found.is_file() else None
    hub = hf_hub(rt)
    if hub is None or model.count("/") != 1:
        return None
    snapshots = hub / ("models--" + model.replace("/", "--")) / "snapshots"
    try:
        configs = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    return configs[-1] if configs else None


def model_config(rt: RuntimeConfig) -> tuple[dict[str, Any], str]:
    """The runtime's model's config.json, read; raises when it is not a vLLM runtime or the
    file is not there."""
    from appliance.measure import capacity

    if rt.engine is not Engine.VLLM:
        raise ApplianceError(
            f"runtimes.{rt.name} runs {rt.engine.value}; the plan is vLLM's",
            hint="plan a vLLM runtime, or a config.json with vLLM's flags",
            code="plan_input_invalid",
        )
    path = find_model_config(rt)
    if path is None:
        raise ApplianceError(
            f"runtimes.{rt.name}: no config.json for {rt.model} on this machine",
            hint="download the model first, or pass its config.json: "
            f"b70ctl plan PATH/config.json {' '.join(rt.args)}",
            code="plan_model_missing",
        )
    return capacity.read_config(path), str(path)


def serve_of(rt: RuntimeConfig) -> serveflags.Serve:
    """The runtime's flags, with the tensor parallelism the appliance adds for its cards
    (appliance.host.placement.selection: one worker per card)."""
    cards = len(rt.cards or ())
    return serveflags.parse(
        [*rt.args, *(["--tensor-parallel-size", str(cards)] if cards > 1 else [])]
    )


def doctor_checks(config: Config, root: Path) -> list[Check]:
    """`doctor`'s check of each vLLM runtime on an Intel GPU: one request of its max model
    length fits, by the plan."""
    from appliance.host.gpu.sysfs import read_devices

    on_gpu = any(d.is_intel for d in read_devices(root))
    out = []
    for rt in sorted(config.runtimes.values(), key=lambda r: r.name):
        if rt.engine is Engine.VLLM and (
            on_gpu or any(d.startswith("/dev/dri") for d in rt.devices)
        ):
            fit = check(rt)
            if fit is not None:
                out.append(Check(f"{rt.name}: fits", fit.ok, fit.detail, fit.fix))
    return out


@dataclass(frozen=True)
class Fit:
    """Whether a vLLM runtime's recipe holds one request of its max model length, by the plan."""

    ok: bool  # False only where the plan is sure it does not
    detail: str
    fix: str | None = None
    notes: tuple[str, ...] = ()


def check(rt: RuntimeConfig) -> Fit | None:
    """The plan's verdict on a vLLM runtime on a B70 (None for llama.cpp). A plan that cannot
    be made (no config.json here) or is unsure of the model lets the start go on, and says so."""
    from appliance.measure import capacity
    from appliance.measure.startlog import gib2, plan_fix, refusal_line

    if rt.engine is not Engine.VLLM:
        return None
    try:
        cfg, _ = model_config(rt)
        p = capacity.plan(cfg, serve_of(rt), env=dict(rt.env))
    except ApplianceError as e:
        return Fit(True, f"not planned: {e.message}", notes=(f"the plan: {e.message}",))
    if p.fits and p.fits_at_least:
        return Fit(
            True,
            f"one request of {p.max_model_len:,} tokens needs {gib2(p.paging.needed_bytes)} GiB of "
            f"the {gib2(p.available_kv_bytes)} GiB cache; {p.max_concurrency:.2f}x at once",
        )
    b = p.budget
    if p.fits or p.fits_at_most:
        note = (
            f"runtimes.{rt.name}: one request of {p.max_model_len:,} tokens needs "
            f"{gib2(p.paging.needed_bytes)} GiB of a cache the plan puts between "
            f"{gib2(b.least)} and {gib2(b.most)} GiB: it may not fit, so the start goes on "
            f"and vLLM will say; `b70ctl plan {rt.name}` shows the plan"
        )
        return Fit(True, note, notes=(note,))
    why = (
        f"runtimes.{rt.name} cannot hold one request of --max-model-len {p.max_model_len}: "
        f'vLLM would load for minutes and then stop with "{refusal_line(p)}", and even at the '
        f"favourable end of the plan's range ({gib2(b.most)} GiB) it would not fit"
    )
    fix = plan_fix(p)
    if p.longest_len or p.utilization_needed is not None:
        fix = f"set {fix} in runtimes.{rt.name}.args"
    fix += f"; `b70ctl plan {rt.name}` shows the plan"
    if p.unsure:
        note = f"{why} ({'; '.join(p.unsure)}: the plan is unsure, so the start goes on)"
        return Fit(True, note, notes=(note,))
    return Fit(False, why, fix)
