"""How vLLM lays out the KV cache of a model on each card, hybrid Gated-DeltaNet models included,
under tensor parallelism: the arithmetic `b70ctl plan` follows for the requests that fit.

Read from vLLM's v1 engine (vllm-project/vllm, 2025-2026):

- A page is one block of one layer. An attention layer's page is block size x KV heads per card
  x (key + value head size) x the KV dtype's bytes (`FullAttentionSpec`, v1/kv_cache_interface.py);
  a GDN layer's page holds one request's whole state: the causal-conv state, (kernel - 1) rows of
  the conv dimension over the cards, and the recurrent state, value heads over the cards x value
  dim x key dim (`MambaSpec`; `MambaStateShapeCalculator.gated_delta_net_state_shape`,
  model_executor/layers/mamba/mamba_utils.py). The conv state has the model's dtype, the
  recurrent state `--mamba-ssm-cache-dtype`.
- Every layer's page must have one size. vLLM raises the attention block size to the smallest
  multiple of the attention kernel's alignment (16 by default) whose page holds the GDN state,
  and pads the GDN page to it (`HybridAttentionMambaModelConfig.verify_and_update_config`,
  model_executor/models/config.py; in newer releases the platform's `update_block_size_for_backend`,
  where XPU's GDN backend rounds the block size to a multiple of 64: XPU_GDN_ALIGN).
- Layers are grouped by type into groups of one size: the smaller type's layer count, or the
  larger's if it is under 1.5 times the smaller (`_get_kv_cache_groups_uniform_page_size`,
  v1/core/kv_cache_utils.py). The cache is group-size tensors of blocks shared by all groups, so
  it holds available // page // group size blocks (`get_num_blocks`), one of them kept as the
  block pool's null block.
- A request takes, in each attention group, one block per block size of tokens, and in each GDN
  group one block, plus one for each speculative token, plus one more in prefix caching's
  `align` mode (`MambaSpec.max_memory_usage_bytes`, v1/kv_cache_interface.py), as vLLM's
  "Maximum concurrency" line counts them: the blocks over the blocks of one request of the max
  model length (`get_max_concurrency_for_kv_cache_config`). Its "GPU KV cache size" is that
  concurrency times the max model length, since vLLM 0.20 (PR #40694, for issue #40691); before
  it, blocks over groups times the block size.
- Speculative decoding's tokens widen the conv state (`kernel - 1 + num_speculative_tokens`
  rows) and an MTP drafter adds its own attention layer; a user's `--block-size` above the
  kernel's alignment becomes the alignment (`Platform._align_hybrid_block_size`,
  vllm/platforms/interface.py).
- A sliding-window layer (gpt-oss, Gemma 3 and 4) is an attention layer whose request holds at
  most its window and one step's tokens, and one block more (`SlidingWindowSpec`); windowed
  layers are a type of their own when grouping. Multi-head latent attention keeps one latent
  of kv_lora_rank + rope dim per token and layer, on every card (`MLAAttentionSpec`).
- KV heads are split over the cards, at least one each (replicated beyond their count:
  `ModelConfig.get_num_kv_heads`); GDN heads must split evenly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.errors import ApplianceError

if TYPE_CHECKING:  # appliance.measure.memory.shape needs nothing from here; kept for typing only
    from appliance.measure.memory.shape import Shape

DEFAULT_ALIGN = 16  # vLLM's attention kernel alignment of block sizes, unless the backend says
# vLLM on XPU (the B70) rounds a hybrid model's block size up to a multiple of 64 when it has a
# GDN layer: "kernel only supports block size dividable by 64" (v0.31,
# XPUPlatform.update_block_size_for_backend in vllm/platforms/xpu.py).
XPU_GDN_ALIGN = 64
NULL_BLOCKS = 1  # the block pool keeps one block that no request gets


@dataclass(frozen=True)
class Paging:
    """The KV cache of one card, as vLLM lays it out."""

    cards: int
    kv_heads_per_card: int
    attention_bytes_per_token: int  # one attention layer on one card
    state_bytes: int  # one GDN layer's state of one request on one card (conv + recurrent)
    block_size: int  # tokens per attention block
    page_bytes: int  # every layer's page, after the sizes are unified
    state_padding: float  # how much larger the GDN page is than its state
    group_size: int  # layers per group
    attention_groups: int
    state_groups: int
    window_groups: int  # groups of layers that attend to a window only
    padding_layers: int  # empty places in the last group of each type
    blocks_per_request: int  # for a request of `tokens`
    bytes_per_request: int  # on one card
    available_bytes: int  # for the cache, on one card
    blocks: int
    requests_fit: int  # of `tokens`, the block pool's null block kept aside
    max_model_len: int
    blocks_per_max_len: int  # what vLLM counts a request of the max model length as
    max_concurrency: float  # vLLM's "Maximum concurrency for N tokens per request"
    kv_cache_tokens: int  # vLLM's "GPU KV cache size: N tokens"
    needed_bytes: int  # the cache one request of the max model length needs
    longest_len: int  # the longest max model length whose one request fits (0: none)


def split_heads(s: Shape, cards: int) -> int:
    """KV heads per card; GDN heads must split evenly over the cards."""
    if cards < 1:
        raise ApplianceError(
            f"--tensor-parallel-size {cards} must be at least 1", code="plan_input_invalid"
        )
    for name, heads in (("linear_num_key_heads", s.lin_k_heads),
                        ("linear_num_value_heads", s.lin_v_heads)):  # fmt: skip
        if s.linear_layers and heads % cards:
            raise ApplianceError(
                f"config.json: {name} {heads} does not split over {cards} cards",
                hint="vLLM's tensor parallelism needs a card count that divides it",
                code="plan_input_invalid",
            )
    return max(1, s.kv_heads // cards)


def layout(
    s: Shape, *, cards: int, kv_bytes: float, conv_bytes: float, state_bytes: float,
    tokens: int, available_bytes: int, align: int = DEFAULT_ALIGN, spec_tokens: int = 0,
    draft_layers: int = 0, align_mode: bool = False, max_model_len: int | None = None,
    min_block: int | None = None, old_token_count: bool = False, batched_tokens: int = 2048,
) -> Paging:  # fmt: skip
    """The layout of one card's cache, and the requests of `tokens` tokens that it holds.
    `draft_layers`: attention layers a drafter adds (MTP: one); `align_mode`: prefix caching's
    mamba `align` mode; `min_block`: the user's --block-size."""
    if align < 1:
        raise ApplianceError(f"--block-align {align} must be at least 1", code="plan_input_invalid")
    kv_heads = split_heads(s, cards)
    # MLA keeps one latent per token, the same on every card
    per_head = s.latent if s.latent else kv_heads * 2 * s.head_dim
    per_token = int(per_head * kv_bytes)
    conv_dim = 2 * s.lin_k_heads * s.lin_k_dim + s.lin_v_heads * s.lin_v_dim
    state = int((s.conv_kernel - 1 + spec_tokens) * (conv_dim // cards) * conv_bytes) + int(
        s.lin_v_heads // cards * s.lin_v_dim * s.lin_k_dim * state_bytes
    )
    full = s.full_layers + draft_layers
    attention = full + s.window_layers
    step = max(align, min_block or 0)
    if s.linear_layers and attention:
        block = step * math.ceil(state / (step * per_token))
        if align == XPU_GDN_ALIGN:
            block = XPU_GDN_ALIGN * math.ceil(block / XPU_GDN_ALIGN)
        block = max(block, min_block or 0)
    else:
        block = min_block or align
    page = block * per_token if attention else state
    counts = [n for n in (full, s.window_layers, s.linear_layers) if n]
    small, large = min(counts), max(counts)
    group = large if large < 1.5 * small else small
    attention_groups = math.ceil(full / group)
    window_groups = math.ceil(s.window_layers / group)
    state_groups = math.ceil(s.linear_layers / group)
    padding = sum(group - n % group for n in counts if n % group)
    per_state = (2 if align_mode else 1) + spec_tokens
    length = max_model_len or tokens

    def blocks_of(n: int) -> int:
        """The blocks of one request of n tokens: a block per block size of tokens in each
        full-attention group; in each windowed group those of its window and of one step's
        tokens, and one more (SlidingWindowSpec.max_memory_usage_bytes); the state's."""
        windowed = math.ceil(min(s.window - 1 + batched_tokens, n) / block) + 1 if s.window else 0
        return (
            attention_groups * math.ceil(n / block)
            + window_groups * windowed
            + state_groups * per_state
        )

    per_request = blocks_of(tokens)
    per_max_len = blocks_of(length)
    blocks = max(available_bytes, 0) // (page * group) if page else 0
    concurrency = blocks / per_max_len if per_max_len else 0.0
    # One request of length L needs blocks_of(L) blocks of group x page bytes: the longest L that
    # fits, in whole attention blocks (the window's and the state's blocks stop growing).
    whole = blocks - (blocks_of(length) - attention_groups * math.ceil(length / block))
    if attention_groups:
        longest = (whole // attention_groups) * block if whole > 0 else 0
    else:  # windows and state alone: past the window, a request of any length takes the same
        longest = length if whole >= 0 and page else 0
    if old_token_count:
        held = blocks // (attention_groups + window_groups + state_groups) * block
    else:
        held = int(concurrency * length)
    return Paging(
        cards=cards,
        kv_heads_per_card=kv_heads,
        attention_bytes_per_token=per_token,
        state_bytes=state if s.linear_layers else 0,
        block_size=block,
        page_bytes=page,
        state_padding=page / state - 1 if s.linear_layers and state else 0.0,
        group_size=group,
        attention_groups=attention_groups,
        state_groups=state_groups,
        window_groups=window_groups,
        padding_layers=padding,
        blocks_per_request=per_request,
        bytes_per_request=per_request * group * page,
        available_bytes=available_bytes,
        blocks=blocks,
        requests_fit=max(blocks - NULL_BLOCKS, 0) // per_request,
        max_model_len=length,
        blocks_per_max_len=per_max_len,
        max_concurrency=concurrency,
        kv_cache_tokens=held,
        needed_bytes=per_max_len * group * page,
        longest_len=longest,
    )
