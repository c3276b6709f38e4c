"""What a quantized checkpoint's weights cost: the method (vLLM's `--quantization`, else the
checkpoint's own `quantization_config`, as vLLM reads it), its bits per weight with its scales,
and which linear layers it covers.

- GPTQ, AWQ and Intel's AutoRound (vLLM's `inc`) store b-bit weights with an fp16 scale and a
  b-bit zero point per group of `group_size` (128 unless the config says): b + (16 + b) / group
  bits a weight (the GPTQ format, AutoGPTQ's and GPTQModel's READMEs).
- FP8 stores one byte a weight; its scales (per tensor, channel or 128 x 128 block) round to
  nothing (vLLM's Fp8Config).
- NVFP4 stores 4 bits a weight and an FP8 scale per 16 (NVIDIA ModelOpt's NVFP4 format): 4.5;
  MXFP4 an 8-bit scale per 32 (OCP Microscaling Formats): 4.25.
- Layers a config leaves out (`modules_to_not_convert`, `ignore`, GPTQModel's `-:` entries of
  `dynamic`, AutoRound's 16-bit `extra_config`) stay in the model's dtype.
The B70 community image (ghcr.io/riceharvest/b70-vllm) casts the layers its `B70_LINEAR_FP8_RE`
names to FP8 and, with `B70_TARGET_LMHEAD_FP8=1`, the head: the plan of a runtime reads them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.measure.memory.shape import PARTS

INT_METHODS = {
    "gptq": "gptq", "gptq_marlin": "gptq", "gptq_bitblas": "gptq", "awq": "awq",
    "awq_marlin": "awq", "inc": "autoround", "auto-round": "autoround", "auto_round": "autoround",
    "intel/auto-round": "autoround", "compressed-tensors": "compressed",
    "compressed_tensors": "compressed",
}  # fmt: skip
FP8_METHODS = {"fp8", "ptpc_fp8", "fbgemm_fp8", "modelopt", "fp8_per_block"}
FP4_METHODS = {"modelopt_fp4", "modelopt_mixed", "nvfp4"}
# MXFP4 (gpt-oss): blocks of 32 FP4 values share one 8-bit power-of-two scale (the OCP
# Microscaling Formats spec): 4.25 bits a weight.
MX_METHODS = {"mxfp4", "modelopt_mxfp4"}
# A name of each part's layers, for a layer pattern to be matched against.
REPRESENTATIVE = {
    "attention": ("self_attn.qkv_proj", "self_attn.o_proj"),
    "linear": ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_qkv", "linear_attn.out_proj"),
    "mlp": ("shared_expert.gate_up_proj", "shared_expert.down_proj", "mlp.gate_up_proj",
            "mlp.down_proj"),
    "experts": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
}  # fmt: skip


@dataclass(frozen=True)
class Quant:
    method: str | None  # None: not quantized
    bits: float | None  # per quantized weight, scales included
    parts: frozenset[str] = frozenset(PARTS)
    fp8_parts: frozenset[str] = frozenset()
    lm_head_bits: float | None = None
    unsure: tuple[str, ...] = field(default=())


def _parts_named(names: list[str]) -> set[str]:
    found = set()
    for name in names:
        if "linear_attn" in name:
            found.add("linear")
        elif "self_attn" in name or re.search(r"(^|\.)attn\.", name):
            found.add("attention")
        elif "shared_expert" in name and "gate." not in name + ".":
            found.add("mlp")
        elif re.search(r"experts\.", name) and "shared" not in name:
            found.add("experts")
    return found


def _left_out(qc: Mapping[str, Any]) -> set[str]:
    names: list[str] = []
    for key in ("modules_to_not_convert", "ignore", "ignored_layers", "exclude_modules"):
        value = qc.get(key)
        if isinstance(value, list):
            names += [str(v) for v in value]
    dynamic = qc.get("dynamic")
    if isinstance(dynamic, dict):
        names += [str(k)[2:] for k in dynamic if str(k).startswith("-:")]
    extra = qc.get("extra_config")
    if isinstance(extra, dict):
        names += [
            str(k) for k, v in extra.items() if isinstance(v, dict) and v.get("bits", 0) >= 16
        ]
    return _parts_named(names)


def _number(qc: Mapping[str, Any], key: str, default: float) -> float:
    value = qc.get(key, default)
    return (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
    )


def resolve(
    cfg: Mapping[str, Any], flag: str | None, env: Mapping[str, str] | None = None
) -> Quant:
    """The quantization of a model served with `--quantization flag` (None: the checkpoint's)."""
    qc = cfg.get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    method = (flag or qc.get("quant_method") or "").lower() or None
    fp8_parts, lm_head_bits = _community_fp8(env or {})
    if method is None:
        return Quant(None, None, frozenset(), fp8_parts, lm_head_bits)
    unsure: list[str] = []
    if method in INT_METHODS:
        if INT_METHODS[method] == "compressed":
            bits, group = _compressed(qc)
        else:
            bits, group = _number(qc, "bits", 4), _number(qc, "group_size", 128)
        per = bits + ((16 + bits) / group if group > 0 else 0.0)
    elif method in FP8_METHODS:
        per = 8.0
    elif method in FP4_METHODS:
        per = 4.5
    elif method in MX_METHODS:
        per = 4.25
    else:
        per = 4.5 if "fp4" in method else 8.0 if "fp8" in method else None  # type: ignore[assignment]
        unsure.append(
            f"quantization {method!r} is not one the plan knows; its weights are a guess"
            if per is not None else
            f"quantization {method!r} is not one the plan knows; "
            "its weights are counted unquantized"
        )  # fmt: skip
        if per is None:
            return Quant(method, None, frozenset(), fp8_parts, lm_head_bits, tuple(unsure))
    if "mixed" in method:
        unsure.append(f"quantization {method!r} mixes precisions the config does not list")
    parts = frozenset(PARTS) - _left_out(qc)
    return Quant(method, per, parts, fp8_parts - parts, lm_head_bits, tuple(unsure))


def _compressed(qc: Mapping[str, Any]) -> tuple[float, float]:
    groups = qc.get("config_groups")
    if isinstance(groups, dict):
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if isinstance(weights, dict):
                size = weights.get("group_size")
                return _number(weights, "num_bits", 4), float(size) if isinstance(
                    size, int
                ) else 0.0
    return 4.0, 128.0


def _community_fp8(env: Mapping[str, str]) -> tuple[frozenset[str], float | None]:
    pattern = env.get("B70_LINEAR_FP8_RE")
    parts: set[str] = set()
    if pattern:
        try:
            rx = re.compile(pattern)
        except re.error:
            rx = None
        if rx is not None:
            parts = {p for p, names in REPRESENTATIVE.items() if any(rx.search(n) for n in names)}
    head = 8.0 if env.get("B70_TARGET_LMHEAD_FP8") == "1" else None
    return frozenset(parts), head
