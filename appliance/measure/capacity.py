"""Capacity math for `b70ctl plan`: what a model costs in memory and how fast it can decode.

Pure functions of a Hugging Face config.json (its shape and byte costs:
appliance.measure.memory.shape) and the dtype and quantization choices:

- per card under tensor parallelism over `cards` cards: weights, what is offloaded to the CPU,
  the cache budget (appliance.measure.memory.budget), and the requests that fit as vLLM lays
  out its cache (appliance.measure.memory.paging);
- the memory-bound decode step: bytes read per step / bandwidth (of all the cards; the
  all-reduce between them is not counted).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import GIB
from appliance.errors import ApplianceError
from appliance.measure import serveflags
from appliance.measure.memory import budget, paging, quant
from appliance.measure.memory.shape import (  # fmt: skip
    DTYPE_BYTES,
    Params,
    Shape,
    conv_state_bytes,
    count_params,
    gdn_state_bytes,
    kv_bytes_per_token,
    parse_shape,
    weight_bytes,
)

DEFAULT_BATCHED_TOKENS = budget.DEFAULT_BATCHED_TOKENS
DEFAULT_MAX_SEQS = budget.DEFAULT_MAX_SEQS


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
    weight_bytes_per_card: int  # on the card: what vLLM logs as "Model loading took"
    cpu_offload_bytes: int  # per card
    available_kv_bytes: int  # per card: vLLM's "Available KV cache memory"
    budget: budget.Budget  # per card: what vLLM asks for, keeps back, and leaves the cache
    requests_fit: int  # of `tokens`, as vLLM lays out the cache (paging)
    block_size: int
    state_padding: float
    kv_cache_tokens: int
    max_concurrency: float
    max_model_len: int
    tokens: int
    fits: bool  # one request of the max model length fits
    fits_at_most: bool  # it fits at the favourable end of the budget's range
    fits_at_least: bool  # it fits at the unfavourable end
    longest_len: int  # the longest --max-model-len whose one request fits
    utilization_needed: float | None  # the --gpu-memory-utilization that holds one (None: none)
    available_given: bool  # the cache was given (logged, or --kv-cache-memory-bytes)
    unsure: list[str]
    paging: paging.Paging
    steps: list[dict[str, float]]


# The memory of one Arc Pro B70: torch's total for it (34,242,297,856 bytes, 31.89 GiB), where
# Intel's runtime says "usable global mem = 30.3 GiB" (clinfo) and vLLM from 0.26 reads 30.30 GiB
# (appliance.measure.memory.budget has which release takes which).
B70_TOTAL_BYTES = budget.TORCH_TOTAL
B70_VISIBLE_BYTES = int(30.3 * GIB)  # what the card can hold: the stand-in's ceiling
CARDS = {"b70": 608e9}  # Intel Arc Pro B70: 608 GB/s GDDR6
DEFAULT_UTILIZATION = budget.DEFAULT_UTILIZATION
# vLLM releases before 0.20 count "GPU KV cache size" as blocks over groups x block size.
NEW_TOKEN_COUNT = (0, 20)


def _dtype_name(serve_dtype: str, cfg: Mapping[str, Any]) -> str:
    if serve_dtype in ("half", "float16"):
        return "fp16"
    if serve_dtype == "bfloat16":
        return "bf16"
    if serve_dtype in ("float", "float32"):
        return "fp32"
    nested = cfg.get("text_config")
    text: Mapping[str, Any] = nested if isinstance(nested, dict) else {}
    named = (
        text.get("dtype") or text.get("torch_dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
    )
    return {"float16": "fp16", "float32": "fp32"}.get(str(named), "bf16")


def _config_value(cfg: Mapping[str, Any], key: str) -> Any:
    text = cfg.get("text_config")
    if isinstance(text, dict) and key in text:
        return text[key]
    return cfg.get(key)


def plan(cfg: Mapping[str, Any], *args: Any, **kwargs: Any) -> Plan:
    """The plan (see `layout_plan`); a config.json the arithmetic cannot take (a field whose
    value no model has) is "not planned", a clear error, never a crash."""
    try:
        return layout_plan(cfg, *args, **kwargs)
    except (ArithmeticError, ValueError, TypeError, KeyError, IndexError, RecursionError) as e:
        raise ApplianceError(
            f"not planned: the plan cannot lay out this config.json ({type(e).__name__}: {e})",
            hint="pass the model's Hugging Face config.json as published",
            code="plan_input_invalid",
        ) from None


def layout_plan(
    cfg: Mapping[str, Any],
    serve: serveflags.Serve | None = None,
    *,
    tokens: int | None = None,
    card_bytes: int | None = None,
    bandwidth: float = CARDS["b70"],
    cache_bytes: int | None = None,
    weights_per_card: int | None = None,
    env: Mapping[str, str] | None = None,
    batches: tuple[int, ...] = (1, 64),
    block_align: int | None = None,
    vllm_version: tuple[int, ...] | None = None,
) -> Plan:
    """The plan of `vllm serve` with `serve`'s flags, as vLLM `vllm_version` (by default the
    B70 image's) takes a B70, or a card of `card_bytes` as the runtime reports it.

    `cache_bytes`: the cache of each card as vLLM measured it ("Available KV cache memory"),
    instead of the budget worked out here; `weights_per_card`: the weights as vLLM logged them
    ("Model loading took"); `env`: the runtime's environment (the B70 image's FP8 casts);
    `tokens`: the length of the requests whose count at once is `requests_fit`."""
    serve = serve or serveflags.Serve()
    s = parse_shape(cfg)
    unsure = list(s.notes)
    dtype = _dtype_name(serve.dtype, cfg)
    q = quant.resolve(cfg, serve.quantization, env)
    unsure += list(q.unsure)
    kv_dtype = dtype if serve.kv_cache_dtype == "auto" else (
        "fp8" if serve.kv_cache_dtype.startswith("fp8") else _dtype_name(serve.kv_cache_dtype, {})
    )  # fmt: skip
    conv_dtype = (
        dtype if serve.mamba_cache_dtype == "auto" else _dtype_name(serve.mamba_cache_dtype, {})
    )
    if serve.mamba_ssm_cache_dtype != "auto":
        state_dtype = _dtype_name(serve.mamba_ssm_cache_dtype, {})
    elif serve.mamba_cache_dtype != "auto":
        state_dtype = conv_dtype
    elif _config_value(cfg, "mamba_ssm_dtype"):  # Qwen3.5's configs: vLLM takes it
        state_dtype = _dtype_name(str(_config_value(cfg, "mamba_ssm_dtype")), {})
    else:
        state_dtype = conv_dtype
    cards = serve.tensor_parallel_size
    p = count_params(s)
    spec = serve.num_speculative_tokens
    mtp = spec > 0 and "mtp" in (serve.speculative_method or "mtp")
    draft_layers = 0
    if mtp:
        layers = _config_value(cfg, "mtp_num_hidden_layers")
        draft_layers = layers if isinstance(layers, int) and layers > 0 else 1
    weights = weight_bytes(p, q.method or "none", dtype, parts=q.parts, bits=q.bits,
                           fp8_parts=q.fp8_parts, lm_head_bits=q.lm_head_bits)  # fmt: skip
    weights += draft_layers * _layer_bytes(s, p, dtype) + (
        _vision_bytes(cfg, dtype) if not serve.language_model_only else 0
    )
    gdn = gdn_state_bytes(s, state_dtype)
    conv = conv_state_bytes(s, conv_dtype)
    kv = kv_bytes_per_token(s, kv_dtype)
    paging.split_heads(s, cards)
    per_card = weights // cards  # linear layers, embedding and head are all split over the cards
    offload = 0
    if serve.cpu_offload_gb and not (
        serve.cpu_offload_params and set(serve.cpu_offload_params) <= {"embed_tokens"}
    ):
        offload = min(int(serve.cpu_offload_gb * GIB), per_card)
    max_len = serve.max_model_len or _max_position(cfg)
    tokens = tokens or max_len
    batched = serve.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    seqs = serve.max_num_seqs or DEFAULT_MAX_SEQS
    loaded = per_card - offload if weights_per_card is None else weights_per_card
    given = serve.kv_cache_memory_bytes or cache_bytes
    release = vllm_version or budget.DEFAULT_RELEASE
    cache_budget = budget.budget(
        s,
        release=release,
        utilization=serve.gpu_memory_utilization,
        weights=loaded,
        cards=cards,
        batched_tokens=batched,
        max_seqs=seqs,
        dtype=dtype,
        total=card_bytes,
        given=given,
        weights_basis="given" if weights_per_card is not None else "worked out",
    )
    kept = sum(term.bytes for term in cache_budget.terms)  # what is not the cache, on each card
    available = cache_budget.available
    if block_align is None:
        block_align = paging.XPU_GDN_ALIGN
    prefix = serve.enable_prefix_caching is not False
    mode = serve.mamba_cache_mode or ("align" if prefix and s.linear_layers else "none")
    if mode == "all":
        unsure.append("mamba cache mode 'all' is laid out as 'align'")
    old = release < NEW_TOKEN_COUNT
    layout = dict(
        cards=cards, kv_bytes=DTYPE_BYTES[kv_dtype], conv_bytes=DTYPE_BYTES[conv_dtype],
        state_bytes=DTYPE_BYTES[state_dtype], align=block_align, spec_tokens=spec,
        draft_layers=draft_layers, align_mode=mode != "none", max_model_len=max_len,
        min_block=serve.block_size, old_token_count=old, batched_tokens=batched,
    )  # fmt: skip
    pages = paging.layout(s, tokens=tokens, available_bytes=available, **layout)  # type: ignore[arg-type]
    fits = pages.needed_bytes <= available
    fits_at_most = pages.needed_bytes <= cache_budget.most
    fits_at_least = pages.needed_bytes <= cache_budget.least
    need = None
    if given is None:
        need = (kept + pages.needed_bytes) / cache_budget.total
        need = math.ceil(need * 100) / 100 if need <= 1 else None
    per_expert, active = _active_params(s, p)
    scale = weights / p.total if p.total else 0.0
    steps = [
        decode_step(s, p, batch, scale, per_expert, gdn, kv * tokens, bandwidth * cards)
        for batch in batches
    ]
    return Plan(
        params=p.total, active_params_per_token=active, weight_bytes=weights,
        gdn_state_bytes=gdn, conv_state_bytes=conv, kv_bytes_per_token=kv,
        request_bytes=gdn + conv + kv * tokens, cards=cards, weight_bytes_per_card=loaded,
        cpu_offload_bytes=offload, available_kv_bytes=available, budget=cache_budget,
        requests_fit=pages.requests_fit, block_size=pages.block_size,
        state_padding=pages.state_padding, kv_cache_tokens=pages.kv_cache_tokens,
        max_concurrency=pages.max_concurrency, max_model_len=max_len, tokens=tokens, fits=fits,
        fits_at_most=fits_at_most, fits_at_least=fits_at_least,
        longest_len=pages.longest_len, utilization_needed=need, available_given=given is not None,
        unsure=unsure, paging=pages, steps=steps,
    )  # fmt: skip


def _max_position(cfg: Mapping[str, Any]) -> int:
    value = _config_value(cfg, "max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else 4096


def _layer_bytes(s: Shape, p: Params, dtype: str) -> int:
    """One decoder layer with full attention, in `dtype`: what an MTP drafter adds."""
    per_layer = (
        p.attention // max(s.attention_layers, 1) + (p.experts + p.always + p.router) // s.layers
    )
    return int((per_layer + 2 * s.hidden * s.hidden) * DTYPE_BYTES[dtype])


def _vision_bytes(cfg: Mapping[str, Any], dtype: str) -> int:
    """The vision tower vLLM loads unless --language-model-only (or every modality's
    --limit-mm-per-prompt is 0): its blocks' attention and MLP, and the merger that folds
    spatial_merge_size² patches into one token of the language model's width (Qwen3-VL's and
    Qwen3.5's `vision_config`: depth, hidden_size, intermediate_size, out_hidden_size)."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    h, depth = vision.get("hidden_size"), vision.get("depth") or vision.get("num_hidden_layers")
    inter = vision.get("intermediate_size") or (4 * h if isinstance(h, int) else None)
    if not (isinstance(h, int) and isinstance(depth, int) and isinstance(inter, int)):
        return 0
    params = depth * (4 * h * h + 2 * h * inter)
    out, merge = vision.get("out_hidden_size"), vision.get("spatial_merge_size")
    if isinstance(out, int) and isinstance(merge, int) and out > 0 and merge > 0:
        folded = merge * merge * h
        params += folded * folded + folded * out
    return max(0, int(params * DTYPE_BYTES[dtype]))


def _active_params(s: Shape, p: Params) -> tuple[float, int]:
    """The parameters of one expert in one layer, and those a token passes through: all but the
    experts, and of those the ones it is routed to."""
    per_expert = (p.experts / (s.moe_layers * s.experts)) if s.experts and s.moe_layers else 0.0
    routed = int(s.moe_layers * s.experts_per_tok * per_expert)
    return per_expert, p.attention + p.linear + p.always + p.router + p.lm_head + routed


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
    touched = s.moe_layers * distinct_experts(s.experts, s.experts_per_tok, batch) * per_expert
    read = (p.attention + p.linear + p.always + p.router + p.lm_head + touched) * scale
    read += batch * (2 * gdn + kv_per_request)  # each request's GDN state read and written, KV read
    step_s = read / bandwidth
    return {
        "batch": batch,
        "bytes_read": read,
        "step_ms": step_s * 1000,
        "tokens_per_s": batch / step_s,
    }


def read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ApplianceError(
            f"{path}: not a readable JSON file: {e}", code="plan_input_invalid"
        ) from None
    if not isinstance(cfg, dict):
        raise ApplianceError(f"{path}: not a JSON object", code="plan_input_invalid")
    return cfg


def parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = text.strip().lstrip("v").split(".")
    try:
        return tuple(int(p) for p in parts[:2])
    except ValueError:
        raise ApplianceError(
            f"--vllm-version {text!r} is not a version such as 0.19 or 0.31",
            code="plan_input_invalid",
        ) from None


def plan_options(cfg: Mapping[str, Any], serve: serveflags.Serve, options: Mapping[str, Any],
                 env: Mapping[str, str] | None = None) -> Plan:  # fmt: skip
    """`b70ctl plan`'s own options around vLLM's flags."""
    check_sizes(options)
    bandwidth, card_bytes = CARDS[options.get("card") or "b70"], None
    if options.get("card_gib") is not None:
        card_bytes = int(options["card_gib"] * GIB)
    if options.get("bandwidth_gbs") is not None:
        bandwidth = options["bandwidth_gbs"] * 1e9
    cache = options.get("kv_cache_gib")
    weights = options.get("weights_gib")
    return plan(
        cfg, serve, tokens=options.get("tokens"), card_bytes=card_bytes, bandwidth=bandwidth,
        cache_bytes=int(cache * GIB) if cache else None,
        weights_per_card=int(weights * GIB) if weights is not None else None,
        env=env, batches=tuple(options.get("batches") or ()) or (1, 64),
        vllm_version=parse_version(options.get("vllm_version")),
    )  # fmt: skip


def check_sizes(options: Mapping[str, Any]) -> None:
    """Memory sizes and bandwidths above zero, batches and tokens of 1 or more."""
    for key, flag, zero_ok in (
        ("card_gib", "--card-gib", False), ("bandwidth_gbs", "--bandwidth-gbs", False),
        ("kv_cache_gib", "--kv-cache-gib", False), ("weights_gib", "--weights-gib", True),
    ):  # fmt: skip
        value = options.get(key)
        if value is not None and not (value >= 0 if zero_ok else value > 0):
            least = "0 or more" if zero_ok else "more than 0"
            raise ApplianceError(f"{flag} {value:g} must be {least}", code="plan_input_invalid")
    for batch in options.get("batches") or ():
        if batch < 1:
            raise ApplianceError(f"--batch {batch} must be at least 1", code="plan_input_invalid")
    tokens = options.get("tokens")
    if tokens is not None and tokens < 1:
        raise ApplianceError(f"--tokens {tokens} must be at least 1", code="plan_input_invalid")
