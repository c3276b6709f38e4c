"""The plan of a vLLM runtime of the appliance's config: its model's config.json, found where vLLM
would read it, and its own args.

A runtime's model is a folder (its config.json inside) or a Hugging Face name, read from the
hub's cache as vLLM reads it: HF_HOME (the runtime's env), a folder mounted at the container's
/root/.cache/huggingface, or this user's ~/.cache/huggingface; in it
hub/models--OWNER--NAME/snapshots/REVISION/config.json.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from appliance.config import Engine, RuntimeConfig
from appliance.errors import ApplianceError
from appliance.measure import serveflags

CONTAINER_HF = "/root/.cache/huggingface"


def names_a_file(target: str) -> bool:
    return target.endswith(".json") or os.sep in target or Path(target).is_file()


def _hub_roots(rt: RuntimeConfig) -> list[Path]:
    roots = []
    home = rt.env.get("HF_HOME")
    for volume in rt.volumes:
        host, _, inside = volume.partition(":")
        inside = inside.split(":")[0]
        if inside.rstrip("/") in (CONTAINER_HF, (home or "").rstrip("/")):
            roots.append(Path(host))
    if home and not rt.volumes:
        roots.append(Path(home))
    roots.append(Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"))
    return roots


def find_model_config(rt: RuntimeConfig) -> Path | None:
    model = rt.model
    if os.path.isabs(model):
        found = Path(model) / "config.json"
        return found if found.is_file() else None
    if model.count("/") != 1:
        return None
    repo = "models--" + model.replace("/", "--")
    for root in _hub_roots(rt):
        snapshots = root / "hub" / repo / "snapshots"
        try:
            configs = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
        except OSError:
            continue
        if configs:
            return configs[-1]
    return None


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
    return serveflags.parse(rt.args)
