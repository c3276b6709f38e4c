"""Capacity math for `b70ctl plan`: what a model costs in memory and how fast it can decode.

Pure functions of a Hugging Face config.json (its shape and byte costs: appliance.measure.shape) and
the dtype and quantization choices:

- per card under tensor parallelism over `cards` cards: weights, what is offloaded to the CPU,
  the cache budget, and the requests that fit as vLLM lays out its cache (appliance.measure.paging);
- the memory-bound decode step: bytes read per step / bandwidth (of all the cards; the
  all-reduce between them is not counted).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.measure import paging
from appliance.measure.shape import (  # fmt: skip
    DTYPE_BYTES,
    QUANT_BITS,
    Params,
    Shape,
    conv_state_bytes,
    count_params,
    gdn_state_bytes,
    kv_bytes_per_token,
    parse_shape,
    weight_bytes,
)
from appliance.sizes import GIB

CARDS = {"b70": (32 * 1024**3, 608e9)}  # Intel Arc Pro B70: 32 GB GDDR6, 608 GB/s


# vLLM's defaults for its OpenAI server on a card under 70 GiB (EngineArgs._set_default_args
# in vllm/engine/arg_utils.py): the start-up profile runs this many tokens at once.
DEFAULT_BATCHED_TOKENS = 2048
DEFAULT_MAX_SEQS = 256


def profile_peak_bytes(s: Shape, cards: int, batched_tokens: int, max_seqs: int, dtype: str) -> int:
    """What vLLM's start-up profile holds at its peak beyond the weights, on each card: vLLM
    keeps it back from the cache.

    vLLM sizes the cache as utilization x total, less what the profile consumed and less its
    transient peak (Worker.determine_available_memory in vllm/v1/worker/gpu_worker.py, which
    the XPU worker uses; memory_profiling in vllm/utils/mem_utils.py). The profile is one
    forward of `batched_tokens` tokens, then the sampler on `max_seqs` rows
    (GPUModelRunner.profile_run, _dummy_run and _dummy_sampler_run in
    vllm/v1/worker/gpu/model_runner.py). Activations live one layer at a time, so the peak is
    the largest layer's, beside the hidden states and the residual:
    - a MoE layer, as the XPU fused-MoE kernel lays it out (XpuFusedMoe._apply_kernel in
      vllm-xpu-kernels' fused_moe_interface.py), for R = tokens x experts per token: the
      tokens regrouped by expert (R x hidden), the gate-up output (R x 2 x intermediate), its
      activation (R x intermediate), the down output (R x hidden), and three tokens x hidden
      copies (the masked input, the output, the residual);
    - a dense MLP: its gate-up output, activation and down output, the same way;
    - a GDN layer: its input projection (in_proj_qkvz) and two value-wide outputs; the GDN
      kernels themselves do not run in the profile (_gdn_attention_core_xpu_impl in
      vllm/_xpu_ops.py returns without attention metadata);
    - a full-attention layer: its q, k and v;
    - the sampler's logits, in fp32.
    What this does not hold: memory outside torch (the runtime's own), and the graph pool vLLM
    estimates before the cache when it captures graphs."""
    if batched_tokens <= 0:
        return 0
    m, b, h = batched_tokens, DTYPE_BYTES[dtype], s.hidden
    if s.experts:
        r, inter = m * s.experts_per_tok, -(-s.moe_inter // cards)
        mlp = r * h + r * 2 * inter + r * inter + r * h + 3 * m * h
    else:
        inter = -(-s.dense_inter // cards)
        mlp = m * 2 * inter + m * inter + m * h + 3 * m * h
    key_dim, value_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
    gdn = m * (2 * key_dim + 2 * value_dim) // cards + 2 * m * value_dim // cards
    attention = m * (s.heads + 2 * s.kv_heads) * s.head_dim // cards
    layer = max(mlp, gdn if s.linear_layers else 0, attention) * b + 2 * m * h * b
    logits = max_seqs * s.vocab * 4
    return int(max(layer, logits))


def distinct_experts(experts: int, per_tok: int, batch: int) -> float:
    """Expected experts a layer touches for `batch` tokens, each picking `per_tok` of them."""
    if experts == 0:
        return 0.0
    return experts * (1 - (1 - per_tok / experts) ** batch)


@dataclass(frozen=True)
class Plan:
    params: int
    active_params_per_token: int
    weight_bytes: int
    gdn_state_bytes: int
    conv_state_bytes: int
    kv_bytes_per_token: int
    request_bytes: int  # GDN state, conv state and KV cache of one request, unpadded
    cards: int
    weight_bytes_per_card: int
    cpu_offload_bytes: int  # per card
    budget_bytes: int  # per card: for the cache, after weights and the reserve
    profile_bytes: int  # per card: the start-up profile's peak, kept back from the cache
    requests_fit: int  # as vLLM lays out the cache (paging)
    paging: paging.Paging
    steps: list[dict[str, float]]


def plan(
    cfg: Mapping[str, Any],
    *,
    dtype: str = "bf16",
    quant: str = "none",
    kv_dtype: str = "bf16",
    state_dtype: str = "fp32",
    card_bytes: int = CARDS["b70"][0],
    bandwidth: float = CARDS["b70"][1],
    utilization: float = 0.9,
    tokens: int = 4096,
    cpu_offload_bytes: int = 0,
    offload_embeddings_only: bool = False,
    reserve_bytes: int = 0,
    batches: tuple[int, ...] = (1, 64),
    cards: int = 1,
    block_align: int | None = None,
    cache_bytes: int | None = None,
    batched_tokens: int = 0,
    max_seqs: int = DEFAULT_MAX_SEQS,
) -> Plan:
    """`cpu_offload_bytes` and `reserve_bytes` are per card, as vLLM's --cpu-offload-gb is;
    `offload_embeddings_only`: --cpu-offload-params embed_tokens, which offloads nothing: vLLM
    offloads only parameters of the decoder layers that make_layers builds (v0.31:
    vllm/model_executor/models/utils.py make_layers, offloader/uva.py wrap_modules), and a
    model's embed_tokens is built outside them. `block_align`: what the block size of a hybrid
    model is rounded to; by default XPU's 64 where the model has GDN layers, else vLLM's 16.
    `cache_bytes`: the cache of each card as vLLM measured it ("Available KV cache memory" in
    its log), instead of the budget worked out here.
    `batched_tokens`, `max_seqs`: vLLM's --max-num-batched-tokens and --max-num-seqs, which
    size its start-up profile (profile_peak_bytes; 0 tokens: none kept back)."""
    _check_choices(dtype=dtype, kv_dtype=kv_dtype, state_dtype=state_dtype, quant=quant)
    s = parse_shape(cfg)
    p = count_params(s)
    weights = weight_bytes(p, quant, dtype)
    gdn = gdn_state_bytes(s, state_dtype)
    conv = conv_state_bytes(s, dtype)
    kv = kv_bytes_per_token(s, kv_dtype)
    request = gdn + conv + kv * tokens
    paging.split_heads(s, cards)
    per_card = weights // cards  # linear layers, embedding and head are all split over the cards
    offload = 0 if offload_embeddings_only else min(cpu_offload_bytes, per_card)
    profile = profile_peak_bytes(s, cards, batched_tokens, max_seqs, dtype)
    budget = int(utilization * card_bytes) - (per_card - offload) - reserve_bytes - profile
    budget = budget if cache_bytes is None else cache_bytes
    if block_align is None:
        block_align = paging.XPU_GDN_ALIGN if s.linear_layers else paging.DEFAULT_ALIGN
    pages = paging.layout(
        s, cards=cards, kv_bytes=DTYPE_BYTES[kv_dtype], conv_bytes=DTYPE_BYTES[dtype],
        state_bytes=DTYPE_BYTES[state_dtype], tokens=tokens, available_bytes=budget,
        align=block_align,
    )  # fmt: skip
    per_expert, active = _active_params(s, p)
    scale = weights / p.total if p.total else 0.0
    steps = [
        decode_step(s, p, batch, scale, per_expert, gdn, kv * tokens, bandwidth * cards)
        for batch in batches
    ]
    return Plan(
        p.total, active, weights, gdn, conv, kv, request, cards, per_card, offload, budget,
        profile, pages.requests_fit, pages, steps,
    )  # fmt: skip


def _active_params(s: Shape, p: Params) -> tuple[float, int]:
    """The parameters of one expert in one layer, and those a token passes through: all but the
    experts, and of those the ones it is routed to."""
    per_expert = (p.experts / (s.layers * s.experts)) if s.experts else 0.0
    routed = int(s.layers * s.experts_per_tok * per_expert)
    return per_expert, p.attention + p.linear + p.always + p.lm_head + routed


def _check_choices(**choices: str) -> None:
    tables: dict[str, tuple[str, Mapping[str, Any]]] = {
        "dtype": ("dtype", DTYPE_BYTES),
        "kv_dtype": ("kv dtype", DTYPE_BYTES),
        "state_dtype": ("state dtype", DTYPE_BYTES),
        "quant": ("quantization", QUANT_BITS),
    }
    for key, value in choices.items():
        name, table = tables[key]
        if value not in table:
            raise ApplianceError(
                f"unknown {name} {value!r}",
                hint="one of: " + ", ".join(sorted(table)),
                code="plan_input_invalid",
            )


def decode_step(
    s: Shape,
    p: Params,
    batch: int,
    scale: float,
    per_expert: float,
    gdn: int,
    kv_per_request: int,
    bandwidth: float,
) -> dict[str, float]:
    """One memory-bound decode step of `batch` requests: the bytes it reads, and its speed."""
    touched = s.layers * distinct_experts(s.experts, s.experts_per_tok, batch) * per_expert
    read = (p.attention + p.linear + p.always + p.lm_head + touched) * scale
    read += batch * (2 * gdn + kv_per_request)  # each request's GDN state read and written, KV read
    step_s = read / bandwidth
    return {
        "batch": batch,
        "bytes_read": read,
        "step_ms": step_s * 1000,
        "tokens_per_s": batch / step_s,
    }


def plan_file(path: Path, options: Mapping[str, Any]) -> Plan:
    """`b70ctl plan`: a Hugging Face config.json and the command's options."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ApplianceError(
            f"{path}: not a readable JSON file: {e}", code="plan_input_invalid"
        ) from None
    if not isinstance(cfg, dict):
        raise ApplianceError(f"{path}: not a JSON object", code="plan_input_invalid")
    check_plan_inputs(options["utilization"], options["tokens"])
    check_sizes(options)
    card_bytes, bandwidth = CARDS[options["card"]]
    if options["card_gib"] is not None:
        card_bytes = int(options["card_gib"] * GIB)
    if options["bandwidth_gbs"] is not None:
        bandwidth = options["bandwidth_gbs"] * 1e9
    return plan(
        cfg,
        dtype=options["dtype"],
        quant=options["quant"],
        kv_dtype=options["kv_dtype"],
        state_dtype=options["state_dtype"],
        card_bytes=card_bytes,
        bandwidth=bandwidth,
        utilization=options["utilization"],
        tokens=options["tokens"],
        cpu_offload_bytes=int(options["cpu_offload_gib"] * GIB),
        offload_embeddings_only=options.get("offload_params") == "embed_tokens",
        reserve_bytes=int(options["reserve_gib"] * GIB),
        batches=tuple(options["batches"]) or (1, 64),
        cards=options.get("cards", 1),
        block_align=options.get("block_align"),
        cache_bytes=int(cache_gib * GIB) if (cache_gib := options.get("kv_cache_gib")) else None,
        batched_tokens=options.get("batched_tokens", DEFAULT_BATCHED_TOKENS),
        max_seqs=options.get("max_seqs", DEFAULT_MAX_SEQS),
    )


def check_plan_inputs(utilization: float, tokens: int) -> None:
    if not 0 < utilization <= 1:
        raise ApplianceError(
            f"--utilization {utilization} must be in (0, 1]", code="plan_input_invalid"
        )
    if tokens < 1:
        raise ApplianceError(f"--tokens {tokens} must be at least 1", code="plan_input_invalid")


def check_sizes(options: Mapping[str, Any]) -> None:
    """Memory sizes and bandwidths above zero (offload and reserve may be zero), batches of 1+."""
    for key, flag, zero_ok in (
        ("card_gib", "--card-gib", False), ("bandwidth_gbs", "--bandwidth-gbs", False),
        ("kv_cache_gib", "--kv-cache-gib", False), ("cpu_offload_gib", "--cpu-offload-gib", True),
        ("reserve_gib", "--reserve-gib", True),
    ):  # fmt: skip
        value = options.get(key)
        if value is not None and not (value >= 0 if zero_ok else value > 0):
            least = "0 or more" if zero_ok else "more than 0"
            raise ApplianceError(f"{flag} {value:g} must be {least}", code="plan_input_invalid")
    for batch in options.get("batches") or ():
        if batch < 1:
            raise ApplianceError(f"--batch {batch} must be at least 1", code="plan_input_invalid")
    for key, flag, lowest in (("batched_tokens", "--max-num-batched-tokens", 0),
                              ("max_seqs", "--max-num-seqs", 1)):  # fmt: skip
        count = options.get(key)
        if count is not None and count < lowest:
            raise ApplianceError(
                f"{flag} {count} must be {lowest} or more", code="plan_input_invalid"
            )
