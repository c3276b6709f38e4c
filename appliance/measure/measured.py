"""What a running vLLM reports about its KV cache, side by side with `b70ctl plan`'s figures.

vLLM exports its cache configuration as the labels of one Prometheus gauge,
`vllm:cache_config_info` (v1/metrics/loggers.py, from CacheConfig's metrics_info()):
`block_size`, `num_gpu_blocks` (the blocks of the cache after profiling), and in newer releases
`kv_cache_memory_bytes` (the cache it measured), `kv_cache_size_tokens` and
`kv_cache_max_concurrency` (requests of `max_model_len` tokens that fit, its log's "Maximum
concurrency"). `/v1/models` gives max_model_len. Labels a release does not have are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from appliance import GIB
from appliance.errors import ApplianceError
from appliance.host.runtime_http import samples

INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class Row:
    what: str
    planned: float
    reported: float

    @property
    def apart(self) -> float | None:
        """(planned - reported) / reported; None when vLLM reported 0."""
        return (self.planned - self.reported) / self.reported if self.reported else None


def cache_info(metrics_text: str) -> dict[str, str]:
    """The labels of vllm:cache_config_info; raises when the text has none, or is not
    Prometheus text."""
    found = samples(metrics_text)
    if found is None:
        raise _compare_failed(f"the runtime's /metrics is not Prometheus text, so it has no {INFO}")
    for sample in found:
        if sample.name == INFO:
            return dict(sample.labels)
    raise _compare_failed(
        f"the runtime's /metrics has no {INFO}: not a vLLM, or one too old to report its cache"
    )


def _compare_failed(message: str) -> ApplianceError:
    return ApplianceError(
        message,
        hint="--compare takes a running vLLM's address, such as http://127.0.0.1:8001",
        code="plan_compare_failed",
    )


def number(labels: dict[str, str], key: str) -> float | None:
    """The label as a finite number; None when it is missing or not one ("None", "NaN", "+Inf")."""
    try:
        value = float(labels[key])
    except (KeyError, ValueError):
        return None
    return value if math.isfinite(value) else None


def compare(plan: Any, at_max_len: Any, labels: dict[str, str], max_len: int | None) -> list[Row]:
    """Rows for every figure vLLM reported: `plan` as asked, `at_max_len` the same plan's layout
    for requests of vLLM's max_model_len (None when unknown)."""
    g = plan.paging
    rows = []
    reported = {k: number(labels, k) for k in labels}
    if (cache := reported.get("kv_cache_memory_bytes")) is not None:
        rows.append(Row("cache on each card, GiB", plan.available_kv_bytes / GIB, cache / GIB))
    if (block := reported.get("block_size")) is not None:
        rows.append(Row("block size (tokens)", g.block_size, block))
    if (blocks := reported.get("num_gpu_blocks")) is not None:
        rows.append(Row("blocks", g.blocks, blocks))
        held = reported.get("kv_cache_size_tokens")
        if held is None and block is not None:
            held = blocks * block
        if held is not None and g.attention_groups:
            rows.append(Row("tokens the cache holds", g.blocks * g.block_size, held))
    fit = reported.get("kv_cache_max_concurrency")
    if fit is not None and at_max_len is not None and max_len:
        rows.append(Row(f"requests of {max_len} tokens that fit", at_max_len.requests_fit, fit))
    return rows


def max_model_len(models_doc: Any) -> int | None:
    """max_model_len of the first model in a /v1/models answer, if it says."""
    try:
        value = models_doc["data"][0]["max_model_len"]
    except (KeyError, IndexError, TypeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


@dataclass(frozen=True)
class Compared:
    url: str
    max_model_len: int | None
    rows: list[Row]


def against(url: str, plan: Any, replan: Any) -> Compared:
    """Ask the vLLM at `url` for its cache and compare `plan`; `replan(tokens)` is the same plan
    for requests of another length."""
    from appliance.host import health

    base = url.rstrip("/")
    try:
        metrics = health.request("GET", base + "/metrics", 10)
        models = health.request("GET", base + "/v1/models", 10)
    except health.NoAnswer as e:
        raise _compare_failed(f"{base}: {e.detail}") from None
    labels = cache_info(metrics.text if metrics.status == 200 else "")
    try:
        length = max_model_len(models.json()) if models.status == 200 else None
    except ValueError:
        length = None
    at_length = replan(length) if length else None
    return Compared(base, length, compare(plan, at_length, labels, length))
