"""A model's shape, read from its Hugging Face config.json, and what its parts cost in bytes.

Hybrid Gated-DeltaNet models such as Qwen3-Next included:

- GDN state per request: value heads x key dim x value dim x linear layers x state bytes
  (plus the small causal-conv state, reported apart);
- KV cache per token of the full-attention layers: 2 x KV heads x head dim x layers x KV bytes;
- weights, from the parameter count per layer type (MoE experts included).
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.measure.memory.archs import Shape, parse_shape

__all__ = ["Shape", "parse_shape"]  # read from config.json in appliance.measure.memory.archs

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


def gdn_state_bytes(s: Shape, state_dtype: str) -> int:
    return int(
        s.lin_v_heads * s.lin_k_dim * s.lin_v_dim * s.linear_layers * DTYPE_BYTES[state_dtype]
    )


def conv_state_bytes(s: Shape, dtype: str) -> int:
    conv_dim = 2 * s.lin_k_heads * s.lin_k_dim + s.lin_v_heads * s.lin_v_dim
    return int(conv_dim * (s.conv_kernel - 1) * s.linear_layers * DTYPE_BYTES[dtype])


def kv_bytes_per_token(s: Shape, kv_dtype: str) -> int:
    """The KV cache of one token in every attention layer (windowed ones too): a key and a
    value per KV head, or multi-head latent attention's one latent."""
    per_layer = s.latent if s.latent else 2 * s.kv_heads * s.head_dim
    return int(per_layer * s.attention_layers * DTYPE_BYTES[kv_dtype])


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


def attention_params(s: Shape) -> int:
    """One attention layer's projections: q, k, v and o, or MLA's (DeepSeek: q through its
    LoRA rank where it has one, the joint KV down-projection to the latent and the rope key,
    its up-projection to keys and values, and o)."""
    if s.latent:
        q_dim = s.heads * (s.nope_dim + s.rope_dim)
        q = s.hidden * s.q_lora + s.q_lora * q_dim if s.q_lora else s.hidden * q_dim
        kv = s.hidden * s.latent + (s.latent - s.rope_dim) * s.heads * (s.nope_dim + s.v_head_dim)
        return q + kv + s.heads * s.v_head_dim * s.hidden
    q_out = s.heads * s.head_dim * (2 if s.gated_attention else 1)
    return (
        s.hidden * q_out + 2 * s.hidden * s.kv_heads * s.head_dim + s.heads * s.head_dim * s.hidden
    )


def count_params(s: Shape) -> Params:
    key_dim, value_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
    gdn = s.hidden * (2 * key_dim + 2 * value_dim)  # in_proj_qkvz
    gdn += s.hidden * 2 * s.lin_v_heads  # in_proj_ba
    gdn += (2 * key_dim + value_dim) * s.conv_kernel  # conv1d
    gdn += value_dim * s.hidden  # out_proj
    dense_layers = s.layers - s.moe_layers
    experts = s.moe_layers * s.experts * 3 * s.hidden * s.moe_inter
    always = (
        s.moe_layers * 3 * s.hidden * s.shared_inter + dense_layers * 3 * s.hidden * s.dense_inter
    )
    router = s.moe_layers * (s.hidden * s.experts + s.hidden) if s.experts else 0
    return Params(
        embed=s.vocab * s.hidden,
        lm_head=0 if s.tied else s.vocab * s.hidden,
        attention=s.attention_layers * attention_params(s),
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
