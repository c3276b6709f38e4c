"""A model's shape, read from its Hugging Face config.json, whatever its architecture spells:

- which layers attend to every token, which to a window only, and which are linear (GDN):
  `layer_types` ("full_attention", "sliding_attention", "linear_attention": gpt-oss, Gemma 3 and
  4, Qwen3.5), `full_attention_interval` (Qwen3-Next, Qwen3.5), `sliding_window_pattern`
  (Gemma 3: every Nth layer global), `attn_type_list` (MiniMax: 1 is softmax attention, 0 its
  linear "lightning" attention);
- experts in every spelling: `num_experts` (Qwen), `num_local_experts` (Mixtral, gpt-oss,
  MiniMax, Llama 4), `n_routed_experts` (DeepSeek); per token `num_experts_per_tok`,
  `experts_per_token`, `top_k_experts`; shared experts `shared_expert_intermediate_size` (Qwen),
  `n_shared_experts` x `moe_intermediate_size` (DeepSeek), Llama 4's one shared expert; the
  layers that keep a dense MLP: `first_k_dense_replace` and `moe_layer_freq` (DeepSeek),
  `mlp_only_layers` and `decoder_sparse_step` (Qwen), `interleave_moe_layer_step` (Llama 4);
- multi-head latent attention (`kv_lora_rank`, DeepSeek): one latent of kv_lora_rank +
  qk_rope_head_dim per token and layer, the same on every card.

A field of the wrong type or out of range is a clear error; a construct the plan does not know
(a layer type, attention whose sizes differ between layers) is named in `notes`, so that the
plan says it is unsure rather than promise memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.errors import ApplianceError

MOST = 1 << 40  # no size of a model is larger: a larger one is a broken config
KNOWN_LAYERS = {"full_attention", "sliding_attention", "linear_attention"}


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
    window_layers: int = 0  # layers that attend to the last `window` tokens only
    window: int = 0
    moe_layers: int = 0  # layers with experts (the others keep a dense MLP)
    latent: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim per token and layer (0: not MLA)
    q_lora: int = 0
    rope_dim: int = 0
    nope_dim: int = 0
    v_head_dim: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def attention_layers(self) -> int:
        return self.full_layers + self.window_layers


def invalid(message: str) -> ApplianceError:
    return ApplianceError(
        f"config.json: {message}",
        hint="pass the model's Hugging Face config.json as published",
        code="plan_input_invalid",
    )


def number(cfg: Mapping[str, Any], key: str, default: int | None = None, least: int = 1) -> int:
    """An integer field between `least` and MOST; `default` when it is missing or null."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise invalid(f"{key} is missing")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{key} is {value!r}, not a whole number")
    if not least <= value <= MOST:
        raise invalid(f"{key} is {value}; it must be between {least} and {MOST}")
    return value


def first(cfg: Mapping[str, Any], *keys: str) -> int:
    """The first of `keys` the config sets (0 when none is)."""
    for key in keys:
        if cfg.get(key) is not None:
            return number(cfg, key, least=0)
    return 0


def _kinds(cfg: Mapping[str, Any], layers: int, notes: list[str]) -> list[str]:
    """Each layer's kind: full_attention, sliding_attention, linear_attention or another."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise invalid("layer_types is not a list of names")
        if len(types) != layers:
            raise invalid(f"layer_types names {len(types)} layers; num_hidden_layers is {layers}")
        odd = sorted(set(types) - KNOWN_LAYERS)
        if odd:
            notes.append(f"layer types {', '.join(odd)} are not ones the plan lays out")
        return list(types)
    attn = cfg.get("attn_type_list")
    if isinstance(attn, list) and len(attn) == layers and all(a in (0, 1) for a in attn):
        if 0 in attn:
            notes.append("MiniMax's lightning (linear) attention layers are not laid out")
        return ["full_attention" if a == 1 else "lightning_attention" for a in attn]
    if cfg.get("full_attention_interval") is not None:
        every = number(cfg, "full_attention_interval")
        return [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ]
    window = cfg.get("sliding_window")
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(window, int) and window > 0 and pattern is not None:
        every = number(cfg, "sliding_window_pattern")
        return [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
        ]
    if isinstance(window, int) and window > 0 and cfg.get("use_sliding_window") is not False:
        notes.append("sliding-window attention is laid out as full attention")
    return ["full_attention"] * layers


def _moe_layers(cfg: Mapping[str, Any], layers: int) -> int:
    """The layers that have experts."""
    dense_first = first(cfg, "first_k_dense_replace")
    every = first(cfg, "moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step") or 1
    skipped = cfg.get("mlp_only_layers")
    only = {i for i in skipped if isinstance(i, int)} if isinstance(skipped, list) else set()
    if cfg.get("moe_layer_freq") is not None:  # DeepSeek: from the first k on, every freq-th
        chosen = [i >= dense_first and i % every == 0 for i in range(layers)]
    else:  # Qwen's sparse step and Llama 4's interleave: every step-th layer, counted from 1
        chosen = [i >= dense_first and (i + 1) % every == 0 for i in range(layers)]
    return sum(1 for i, moe in enumerate(chosen) if moe and i not in only)


def parse_shape(cfg: Mapping[str, Any]) -> Shape:
    """The shape of the language model a config.json describes (a multimodal one's
    `text_config`)."""
    if not isinstance(cfg, Mapping):
        raise invalid("not a JSON object")
    text = cfg.get("text_config")
    if isinstance(text, dict):  # multimodal configs nest the language model
        cfg = {**cfg, **text}
    notes: list[str] = []
    layers = number(cfg, "num_hidden_layers")
    kinds = _kinds(cfg, layers, notes)
    full = kinds.count("full_attention")
    windowed = kinds.count("sliding_attention")
    linear = kinds.count("linear_attention")
    heads = number(cfg, "num_attention_heads")
    hidden = number(cfg, "hidden_size")
    window = number(cfg, "sliding_window", 0, least=0) if windowed else 0
    if windowed and not window:
        raise invalid("sliding_attention layers with no sliding_window")
    experts = first(cfg, "num_experts", "num_local_experts", "n_routed_experts")
    per_tok = first(cfg, "num_experts_per_tok", "experts_per_token", "top_k_experts", "moe_topk")
    if experts and not 0 < per_tok <= experts:
        raise invalid(f"{per_tok} experts per token of {experts}")
    dense_inter = number(cfg, "intermediate_size", 0, least=0)
    moe_inter = first(cfg, "moe_intermediate_size") or (dense_inter if experts else 0)
    shared = first(cfg, "shared_expert_intermediate_size", "shared_intermediate_size")
    shared += first(cfg, "n_shared_experts") * moe_inter
    if experts and cfg.get("interleave_moe_layer_step") is not None:  # Llama 4: one shared
        shared = shared or moe_inter
        dense_inter = first(cfg, "intermediate_size_mlp") or dense_inter
    latent = 0
    if cfg.get("kv_lora_rank") is not None:
        latent = number(cfg, "kv_lora_rank") + number(cfg, "qk_rope_head_dim", 0, least=0)
        notes.append(
            "multi-head latent attention: vLLM's MLA backends on Intel GPUs are unconfirmed"
        )
    if cfg.get("num_global_key_value_heads") is not None or cfg.get("global_head_dim"):
        notes.append(
            "global layers with their own KV heads or head size are laid out as the others"
        )
    if cfg.get("enable_moe_block"):  # Gemma 4: a dense MLP beside the experts in every layer
        shared += dense_inter
    moe_layers = _moe_layers(cfg, layers) if experts else 0
    head_dim = number(cfg, "head_dim", hidden // heads or 1)
    return Shape(
        hidden=hidden,
        layers=layers,
        vocab=number(cfg, "vocab_size"),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        full_layers=full,
        linear_layers=linear,
        heads=heads,
        kv_heads=number(cfg, "num_key_value_heads", heads),
        head_dim=head_dim,
        gated_attention=bool(cfg.get("attn_output_gate", False)),
        lin_k_heads=number(cfg, "linear_num_key_heads", 0, least=0),
        lin_v_heads=number(cfg, "linear_num_value_heads", 0, least=0),
        lin_k_dim=number(cfg, "linear_key_head_dim", 0, least=0),
        lin_v_dim=number(cfg, "linear_value_head_dim", 0, least=0),
        conv_kernel=number(cfg, "linear_conv_kernel_dim", 4),
        experts=experts,
        experts_per_tok=per_tok if experts else 0,
        moe_inter=moe_inter,
        shared_inter=shared,
        dense_inter=dense_inter,
        window_layers=windowed,
        window=window,
        moe_layers=moe_layers,
        latent=latent,
        q_lora=number(cfg, "q_lora_rank", 0, least=0) if latent else 0,
        rope_dim=number(cfg, "qk_rope_head_dim", 0, least=0) if latent else 0,
        nope_dim=number(cfg, "qk_nope_head_dim", head_dim, least=0) if latent else 0,
        v_head_dim=number(cfg, "v_head_dim", head_dim, least=0) if latent else 0,
        notes=tuple(notes),
    )
