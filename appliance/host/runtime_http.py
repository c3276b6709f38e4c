"""What a runtime answers over HTTP besides its API: its health path, and its own Prometheus
metrics, read with prometheus-client's parser."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.samples import Sample

HEALTH_PATH = "/health"  # both engines: 200 only once the model is loaded
METRICS_PATH = "/metrics"
# Requests a runtime is working on, and requests it has accepted but not started, by engine.
RUNNING_METRICS = ("vllm:num_requests_running", "llamacpp:requests_processing")
WAITING_METRICS = ("vllm:num_requests_waiting", "llamacpp:requests_deferred")
# Tokens generated since the runtime started (counters).
GENERATED_METRICS = ("vllm:generation_tokens_total", "llamacpp:tokens_predicted_total")


def samples(metrics_text: str) -> list[Sample] | None:
    """Every sample of Prometheus text, as prometheus-client's parser reads it; None when a line
    is not Prometheus text: a document that is partly wrong is not trusted for any count.

    Samples keep the names the text gives them (`llamacpp:requests_processing`, a counter's
    `..._total`, a histogram's `_bucket`, `_sum` and `_count`), label values are unescaped, and a
    timestamp after the value is not read as the value."""
    # Imported here: every switch imports this module, and reads metrics only in some drains.
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [s for f in text_string_to_metric_families(metrics_text) for s in f.samples]
    except ValueError:
        return None


def metric_sum(metrics_text: str, names: tuple[str, ...]) -> float | None:
    """The sum of every sample of the named metrics in Prometheus text; None if there is none,
    if the text is not Prometheus text, or if the sum is not a finite number (NaN, +Inf)."""
    values = [s.value for s in samples(metrics_text) or () if s.name in names]
    total = sum(values, 0.0)
    return total if values and math.isfinite(total) else None


def parse_in_flight(metrics_text: str) -> int | None:
    """Requests a runtime is running or has queued, from its Prometheus text; None if unknown."""
    running = metric_sum(metrics_text, RUNNING_METRICS)
    if running is None:
        return None
    total = running + (metric_sum(metrics_text, WAITING_METRICS) or 0)
    return int(total) if math.isfinite(total) else None
