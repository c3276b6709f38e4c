"""The lines vLLM prints at start-up for a plan (appliance.measure.capacity), in its words and
rounding, and what would let a recipe that cannot fit fit."""

from __future__ import annotations

from typing import Any


def gib2(n: float) -> str:
    """vLLM's format_gib: GiB rounded to two places, as Python prints the float."""
    return str(round(n / 1024**3, 2))


def plan_log(p: Any) -> list[str]:
    """The lines vLLM prints at start-up for this plan, in its words and rounding."""
    g = p.paging
    lines = [f"Model loading took {gib2(p.weight_bytes_per_card)} GiB memory"]
    if g.state_groups and g.attention_groups:
        lines.append(
            f"Setting attention block size to {g.block_size} tokens to ensure that attention "
            "page size is >= mamba page size."
        )
        if g.state_padding > 0:
            lines.append(
                f"Padding mamba page size by {g.state_padding * 100:.2f}% to ensure that mamba "
                "page size and attention page size are exactly equal."
            )
    if g.padding_layers:
        lines.append(f"Add {g.padding_layers} padding layers to the KV cache groups")
    lines.append(f"Available KV cache memory: {gib2(p.available_kv_bytes)} GiB")
    if p.fits:
        lines += [
            f"GPU KV cache size: {p.kv_cache_tokens:,} tokens",
            f"Maximum concurrency for {p.max_model_len:,} tokens per request: "
            f"{p.max_concurrency:.2f}x",
        ]
    else:
        lines.append(refusal_line(p))
    return lines


def refusal_line(p: Any) -> str:
    return (
        "ValueError: To serve at least one request with the model's max seq len "
        f"({p.max_model_len}), ({gib2(p.paging.needed_bytes)} GiB KV cache is needed, which is "
        f"larger than the available KV cache memory ({gib2(p.available_kv_bytes)} GiB)."
    )


def plan_fix(p: Any) -> str:
    """What would let one request of the max model length fit."""
    fixes = []
    if p.longest_len:
        fixes.append(f"--max-model-len {p.longest_len} or less")
    if p.utilization_needed is not None:
        fixes.append(f"--gpu-memory-utilization {p.utilization_needed:.2f}")
    if not fixes:
        return (
            "the model does not fit this card: more cards (--tensor-parallel-size) "
            "or a smaller quantization"
        )
    return " or ".join(fixes)
