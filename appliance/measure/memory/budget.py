"""The memory vLLM's worker leaves for the KV cache on each card of an Intel GPU, term by term, as
each release takes it.

Every release asks for `ceil(total x --gpu-memory-utilization)` of the card at start
(`request_memory`, vllm/v1/worker/utils.py) and gives the cache what is left of it once the
memory that is not the cache is counted (`Worker.determine_available_memory`,
vllm/v1/worker/gpu_worker.py, which `XPUWorker` inherits in every release read here: 0.23, 0.24,
0.26, 0.27, 0.31, 0.34, from their sdists on PyPI). What differs between releases:

- the card's total: torch's `mem_get_info` before 0.26 (torch 2.11 and 2.12 give a B70
  34,242,297,856 bytes, 31.89 GiB), vLLM's own `getMemoryInfo` op from 0.26 on
  (vllm/platforms/xpu.py), which gives a B70 30.30 GiB (vllm-project/vllm#53990, with
  compute-runtime 26.05 and torch 2.13; `torch.xpu.mem_get_info` said the same there);
- what is not the cache: before 0.27, the weights as loaded, torch's peak during the start-up
  profile above what it held before it, and the growth of memory outside torch
  (`memory_profiling`, vllm/utils/mem_utils.py); from 0.27, the drop in the card's free memory
  since the worker's first snapshot plus torch's peak above what it still holds, which counts
  the same weights, activations and runtime memory;
- graphs: from 0.31, an estimate of the graph pool is subtracted on XPU too when graphs are
  captured (`is_cuda_alike() or is_xpu()`, 0.31 gpu_worker.py), and XPU captures them unless
  `--enforce-eager` (XPUPlatform.check_and_update_config: torch 2.11 and newer).

The profile is one forward of `--max-num-batched-tokens` tokens and the sampler on
`--max-num-seqs` rows (`GPUModelRunner.profile_run`, `_dummy_run`, `_dummy_sampler_run`). The
largest layer's activations and the sampler's rows are worked out from the model's shape; what the
runtime holds outside torch (Level Zero's modules, oneCCL's buffers), and the part of the profile
that grows with --max-num-seqs beyond the sampler's rows, have no mechanism the plan can follow, so
they are fitted to the B70 logs that state their weights (b70tools/plan_fit.py prints the fit and
its leave-one-out error; docs/plan.md has the table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance import GIB
from appliance.measure.memory.shape import DTYPE_BYTES, Shape

TORCH_TOTAL = 34_242_297_856  # a B70 as torch 2.11 and 2.12 report it
GETMEMORYINFO_TOTAL = int(30.30 * GIB)  # a B70 as vLLM's getMemoryInfo reports it (#53990)
DEFAULT_RELEASE = (0, 31)  # the release the B70 image `b70ctl setup` writes runs
DEFAULT_BATCHED_TOKENS = 2048  # EngineArgs defaults for the OpenAI server on a card under 70 GiB
DEFAULT_MAX_SEQS = 256
DEFAULT_UTILIZATION = 0.92
# The sampler's dummy run keeps fp32 rows of the vocabulary alive at once: the logits cast to
# fp32, the probabilities, and the exponential noise they are divided by (random_sample in
# vllm/v1/sample/ops/topk_topp_sampler.py).
SAMPLER_ROWS = 3

# Fitted (b70tools/plan_fit.py), in bytes on each card. Before 0.26, on the five B70 logs that
# state their weights (L1, L8, L9, L10, L11): what the runtime holds outside torch, what each of
# --max-num-seqs (up to the 128 the logs reach) holds beyond its sampler rows, and what each card
# holds once there are two. From 0.26, on the seed recipe's 61 requests of 1,024 tokens at 0.82
# on one B70 (examples/b70.toml): the runtime's memory and the graph pool together.
FIT_BASE = int(0.132 * GIB)
FIT_PER_SEQUENCE = int(0.024 * GIB)
FIT_SEQUENCES = 128
FIT_SECOND_CARD = int(0.4805 * GIB)
FIT_RUNTIME_NEW = int(0.65 * GIB)
# How far the fitted terms missed, each log left out of the fit in turn: the cache was up to
# ERROR_BELOW smaller and up to ERROR_ABOVE larger than the plan said (b70tools/plan_fit.py).
ERROR_BELOW = int(0.95 * GIB)
ERROR_ABOVE = int(1.03 * GIB)


@dataclass(frozen=True)
class Term:
    """One figure the budget subtracts from what vLLM asks for."""

    key: str
    bytes: int
    basis: str  # how the plan knows it: "given", "worked out" or "fitted"
    what: str


@dataclass(frozen=True)
class Budget:
    """What vLLM asks for on each card, what it keeps back, and the cache left, with the range
    the fitted terms' demonstrated error puts around it."""

    release: tuple[int, ...]
    total: int
    utilization: float
    requested: int
    terms: tuple[Term, ...]
    available: int
    least: int  # the cache at the unfavourable end of the range
    most: int  # at the favourable end
    given: bool  # the cache was given (a log's figure, or --kv-cache-memory-bytes)


def card_total(release: tuple[int, ...]) -> int:
    return GETMEMORYINFO_TOTAL if release >= (0, 26) else TORCH_TOTAL


def activation_bytes(s: Shape, cards: int, batched_tokens: int, dtype: str) -> int:
    """The largest layer's activations in one forward of `batched_tokens` tokens, beside the
    hidden states and the residual: torch's peak above the weights during the profile.

    - a MoE layer, as the XPU fused-MoE kernel lays it out (XpuFusedMoe._apply_kernel in
      vllm-xpu-kernels' fused_moe_interface.py), for R = tokens x experts per token: the tokens
      regrouped by expert (R x hidden), the gate-up output (R x 2 x intermediate), its activation
      (R x intermediate), the down output (R x hidden), and three tokens x hidden copies;
    - a dense MLP: its gate-up output, activation and down output, the same way;
    - a GDN layer: its input projection and two value-wide outputs (the GDN kernels return
      without attention metadata in the profile: `attn_metadata is None`);
    - an attention layer: its q, k and v."""
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
    return int(max(mlp, gdn if s.linear_layers else 0, attention) * b + 2 * m * h * b)


def sampler_bytes(s: Shape, max_seqs: int, batched_tokens: int) -> int:
    """The sampler's dummy run: one fp32 row of the vocabulary per request, SAMPLER_ROWS times
    (the requests of the profile's batch: --max-num-seqs, at most one per token)."""
    rows = min(max_seqs, max(batched_tokens, 1))
    return rows * s.vocab * 4 * SAMPLER_ROWS


def budget(
    s: Shape,
    *,
    release: tuple[int, ...],
    utilization: float,
    weights: int,
    cards: int,
    batched_tokens: int,
    max_seqs: int,
    dtype: str,
    total: int | None = None,
    given: int | None = None,
    weights_basis: str = "worked out",
) -> Budget:
    """The cache vLLM `release` leaves on each card. `total`: the card as the runtime reports
    it (default: the release's); `given`: the cache itself (--kv-cache-memory-bytes, or a log's
    figure), which vLLM takes without profiling."""
    total = card_total(release) if total is None else total
    terms = _terms(s, release, weights, cards, batched_tokens, max_seqs, dtype, weights_basis)
    requested = math.ceil(total * utilization)
    if given is not None:
        return Budget(release, total, utilization, requested, terms, given, given, given, True)
    available = requested - sum(t.bytes for t in terms)
    low = high = available
    if release >= (0, 26):
        # The B70 logs of 0.23 and 0.24 were taken by the older rule, and one of a 0.26 image
        # (intel/llm-scaler#672) is nearer it: the range holds both rules.
        older = _terms(s, (0, 24), weights, cards, batched_tokens, max_seqs, dtype, weights_basis)
        other = math.ceil(TORCH_TOTAL * utilization) - sum(t.bytes for t in older)
        low, high = min(available, other), max(available, other)
    return Budget(
        release,
        total,
        utilization,
        requested,
        terms,
        available,
        low - ERROR_BELOW,
        high + ERROR_ABOVE,
        False,
    )


def _terms(
    s: Shape,
    release: tuple[int, ...],
    weights: int,
    cards: int,
    batched_tokens: int,
    max_seqs: int,
    dtype: str,
    weights_basis: str,
) -> tuple[Term, ...]:
    """What `release` keeps back from the cache on each card, term by term."""
    act = activation_bytes(s, cards, batched_tokens, dtype)
    rows = min(max_seqs, max(batched_tokens, 1))
    terms = [
        Term("weights", weights, weights_basis, 'the weights on the card ("Model loading took")'),
        Term(
            "activations",
            act,
            "worked out",
            f"the largest layer's activations for {batched_tokens:,} tokens at once",
        ),
        Term(
            "sampler",
            sampler_bytes(s, max_seqs, batched_tokens),
            "worked out",
            f"the sampler's fp32 rows for {rows} requests",
        ),
    ]
    if release >= (0, 26):
        terms.append(
            Term(
                "runtime", FIT_RUNTIME_NEW, "fitted", "the runtime's own memory and the graph pool"
            )
        )
        return tuple(terms)
    seqs = min(max_seqs, FIT_SEQUENCES)
    terms += [
        Term("runtime", FIT_BASE, "fitted", "the runtime's own memory outside torch"),
        Term(
            "sequences",
            FIT_PER_SEQUENCE * seqs,
            "fitted",
            f"what the logs show held for each of {seqs} requests beyond its sampler rows",
        ),
    ]
    if cards > 1:
        terms.append(
            Term(
                "second card",
                FIT_SECOND_CARD,
                "fitted",
                "what each card holds once there are two or more",
            )
        )
    return tuple(terms)
