"""A model's shape, read from its Hugging Face config.json, and what its parts cost in bytes.

Hybrid Gated-DeltaNet models such as Qwen3-Next included:

- GDN state per request: value heads x key dim x value dim x linear layers x state bytes
  (plus the small causal-conv state, reported apart);
- KV cache per token of the full-attention layers: 2 x KV heads x head dim x layers x KV bytes;
- weights, from the parameter count per layer type (MoE experts included).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.errors import ApplianceError

DTYPE_BYTES = {
    "fp32": 4.0, "float32": 4.0, "fp16": 2.0, "float16": 2.0, "bf16": 2.0, "bfloat16": 2.0,
    "fp8": 1.0, "int8": 1.0,
}  # fmt: skip
# Bits per weight of the quantized linear layers, scales included.
QUANT_BITS = {
    "none": None,  # the weights dtype
    "fp8": 8.0,
    "gptq-int4": 4.0 + (16 + 4) / 128,  # 4-bit weights, an fp16 scale and a 4-bit zero per 128
    "gptq-int8": 8.0 + (16 + 8) / 128,
    "q8_0": 8.5,  # GGUF: 32 weights share an fp16 scale
    "q4_k_m": 4.85,  # GGUF mixture, the average llama.cpp reports for Q4_K_M
}


@dataclass(frozen=True)
class Shape:
    """The sizes of a model that its memory and its decode step depend on."""

    hidden: int
    layers: int
    vocab: int
    tied: bool
    full_layers: int
    linear_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    gated_attention: bool
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    experts: int
    experts_per_tok: int
    moe_inter: int
    shared_inter: int
    dense_inter: int


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None, least: int = 1) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        if default is None:
            raise ApplianceError(
                f"config.json: {key} is missing or not an integer",
                hint="pass the model's Hugging Face config.json",
                code="plan_input_invalid",
            )
        value = default
    if value < least:
        raise ApplianceError(
            f"config.json: {key} is {value}; it must be at least {least}",
            hint="pass the model's Hugging Face config.json",
            code="plan_input_invalid",
        )
    return value


def parse_shape(cfg: Mapping[str, Any]) -> Shape:
    text = cfg.get("text_config")
    if isinstance(text, dict):  # multimodal configs nest the language model
        cfg = {**cfg, **text}
    layers = _int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        full = sum(1 for t in types if t == "full_attention")
    elif "full_attention_interval" in cfg:
        interval = _int(cfg, "full_attention_interval")
        full = layers // interval
    else:
        full = layers
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    return Shape(
        hidden=hidden,
        layers=layers,
        vocab=_int(cfg, "vocab_size"),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        full_layers=full,
        linear_layers=layers - full,
        heads=heads,
        kv_heads=_int(cfg, "num_key_value_heads", heads),
        head_dim=_int(cfg, "head_dim", hidden // heads),
        gated_attention=bool(cfg.get("attn_output_gate", False)),
        lin_k_heads=_int(cfg, "linear_num_key_heads", 0, least=0),
        lin_v_heads=_int(cfg, "linear_num_value_heads", 0, least=0),
        lin_k_dim=_int(cfg, "linear_key_head_dim", 0, least=0),
        lin_v_dim=_int(cfg, "linear_value_head_dim", 0, least=0),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim", 4),
        experts=_int(cfg, "num_experts", 0, least=0),
        experts_per_tok=_int(cfg, "num_experts_per_tok", 0, least=0),
        moe_inter=_int(cfg, "moe_intermediate_size", 0, least=0),
        shared_inter=_int(cfg, "shared_expert_intermediate_size", 0, least=0),
        dense_inter=_int(cfg, "intermediate_size", 0, least=0),
    )


def gdn_state_bytes(s: Shape, state_dtype: str) -> int:
    return int(
        s.lin_v_heads * s.lin_k_dim * s.lin_v_dim * s.linear_layers * DTYPE_BYTES[state_dtype]
    )


def conv_state_bytes(s: Shape, dtype: str) -> int:
    conv_dim = 2 * s.lin_k_heads * s.lin_k_dim + s.lin_v_heads * s.lin_v_dim
    return int(conv_dim * (s.conv_kernel - 1) * s.linear_layers * DTYPE_BYTES[dtype])


def kv_bytes_per_token(s: Shape, kv_dtype: str) -> int:
    return int(2 * s.kv_heads * s.head_dim * s.full_layers * DTYPE_BYTES[kv_dtype])


@dataclass(frozen=True)
class Params:
    """Parameter counts by the part of the model they belong to."""

    embed: int
    lm_head: int
    attention: int  # every full-attention layer
    linear: int  # every GDN layer
    experts: int  # every routed expert of every layer
    always: int  # shared experts and dense MLPs: read for every token
    router: int = 0  # the routers (and the shared experts' gates): never quantized

    @property
    def total(self) -> int:
        return (
            self.embed + self.lm_head + self.attention + self.linear + self.experts + self.always
            + self.router
        )  # fmt: skip


def count_params(s: Shape) -> Params:
    q_out = s.heads * s.head_dim * (2 if s.gated_attention else 1)
    attn = (
        s.hidden * q_out + 2 * s.hidden * s.kv_heads * s.head_dim + s.heads * s.head_dim * s.hidden
    )
    key_dim, value_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
    gdn = s.hidden * (2 * key_dim + 2 * value_dim)  # in_proj_qkvz
    gdn += s.hidden * 2 * s.lin_v_heads  # in_proj_ba
    gdn += (2 * key_dim + value_dim) * s.conv_kernel  # conv1d
    gdn += value_dim * s.hidden  # out_proj
    if s.experts:
        experts = s.layers * s.experts * 3 * s.hidden * s.moe_inter
        always = s.layers * 3 * s.hidden * s.shared_inter
        router = s.layers * (s.hidden * s.experts + s.hidden)
    else:
        experts = router = 0
        always = s.layers * 3 * s.hidden * s.dense_inter
    return Params(
        embed=s.vocab * s.hidden,
        lm_head=0 if s.tied else s.vocab * s.hidden,
        attention=s.full_layers * attn,
        linear=s.linear_layers * gdn,
        experts=experts,
        always=always,
        router=router,
    )


PARTS = ("attention", "linear", "experts", "mlp")  # the linear layers a quantization may cover


def part_params(p: Params) -> dict[str, int]:
    return {"attention": p.attention, "linear": p.linear, "experts": p.experts, "mlp": p.always}


def weight_bytes(
    p: Params, quant: str, dtype: str, *, parts: frozenset[str] = frozenset(PARTS),
    bits: float | None = None, fp8_parts: frozenset[str] = frozenset(),
    lm_head_bits: float | None = None,
) -> int:  # fmt: skip
    """The model's weights: `parts` quantized at `bits` per weight (scales included; by default
    QUANT_BITS[quant]), `fp8_parts` at 8 bits, the rest, embeddings and the head in `dtype`."""
    dense = DTYPE_BYTES[dtype]
    if bits is None:
        bits = QUANT_BITS.get(quant)
    total = 0.0
    for part, n in part_params(p).items():
        if bits is not None and part in parts:
            total += n * bits / 8
        elif part in fp8_parts:
            total += n
        else:
            total += n * dense
    head = p.lm_head * (lm_head_bits / 8 if lm_head_bits else dense)
    return int(total + head + (p.embed + p.router) * dense)
