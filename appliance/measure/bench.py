"""`b70ctl bench`: measure a runtime the way the B70 recipes were measured.

Random-token prompts of a fixed length, answers of a fixed length with ignore_eos, greedy and
streaming, N requests with at most C in flight. While it runs, the runtime's own metrics are
sampled for how many requests really run at once; the generation figure (C / median TPOT) is
reported only when C requests did. The metrics are read every half second, and also each time
C streams are between their first token and their end as the client sees them: the moment the
runtime must be running all C, however short the answers are.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from appliance.config import Config
from appliance.host.runtime_http import RUNNING_METRICS, metric_sum
from appliance.layout import Scope

SAMPLE_EVERY_S = 0.5  # often enough to follow the run, rarely enough not to load the server


class Streaming:
    """How many streams the client has between their first token and their end; `full` is set
    each time that count reaches the concurrency, so that the sampler looks right then."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.now = 0
        self.full = asyncio.Event()

    def first_token(self) -> None:
        self.now += 1
        if self.now >= self.concurrency:
            self.full.set()

    def ended(self) -> None:
        self.now -= 1


@dataclass(frozen=True)
class Workload:
    url: str  # base URL of an OpenAI-compatible server (the proxy, or a runtime)
    model: str
    api_key: str
    requests: int = 128
    concurrency: int = 64
    input_tokens: int = 512
    output_tokens: int = 512
    seed: int = 0
    ignore_eos: bool = True


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def parse_running(metrics_text: str) -> int | None:
    """Requests running now, from vLLM's or llama-server's Prometheus text."""
    running = metric_sum(metrics_text, RUNNING_METRICS)
    return None if running is None else int(running)


def random_token_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def _stream_one(
    client: httpx.AsyncClient, w: Workload, prompt: str, t0: float, streaming: Streaming
) -> RequestResult:
    body: dict[str, Any] = {
        "model": w.model,
        "prompt": prompt,
        "max_tokens": w.output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if w.ignore_eos:
        body["ignore_eos"] = True
    result = RequestResult(ok=False, start_s=time.perf_counter() - t0)
    start = time.perf_counter()
    last: float | None = None
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", w.url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                usage = event.get("usage") or usage
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                        streaming.first_token()
                    else:
                        result.itls_s.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    finally:
        if last is not None:
            streaming.ended()
    result.latency_s = time.perf_counter() - start
    result.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    result.prompt_tokens = int(usage["prompt_tokens"]) if usage else None
    result.ok = result.ttft_s is not None
    if not result.ok:
        result.error = "the stream carried no tokens"
    return result


async def _either(a: asyncio.Event, b: asyncio.Event, timeout_s: float) -> None:
    """Wait until either event is set, or the time is up."""
    waits = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    await asyncio.gather(*waits, return_exceptions=True)


async def _sample(
    metrics_url: str | None,
    samples: list[tuple[float, int]],
    t0: float,
    stop: asyncio.Event,
    streaming: Streaming,
) -> None:
    if not metrics_url:
        return
    async with httpx.AsyncClient(timeout=2) as client:
        while not stop.is_set():
            streaming.full.clear()
            try:
                running = parse_running((await client.get(metrics_url)).text)
            except httpx.HTTPError:
                running = None
            if running is not None:
                samples.append((round(time.perf_counter() - t0, 3), running))
            await _either(stop, streaming.full, SAMPLE_EVERY_S)


async def run(
    w: Workload,
    prompts: list[str],
    metrics_url: str | None,
    progress: Callable[[int, int, int], None] | None = None,
) -> tuple[list[RequestResult], list[tuple[float, int]], float]:
    """Send every prompt with at most `concurrency` in flight. Returns results, samples, wall s."""
    limits = httpx.Limits(max_connections=w.concurrency, max_keepalive_connections=w.concurrency)
    headers = {"Authorization": f"Bearer {w.api_key}"}
    samples: list[tuple[float, int]] = []
    stop = asyncio.Event()
    gate = asyncio.Semaphore(w.concurrency)
    streaming = Streaming(w.concurrency)
    results: list[RequestResult] = []
    tokens = 0
    t0 = time.perf_counter()
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=30), limits=limits, headers=headers
    ) as client:
        sampler = asyncio.create_task(_sample(metrics_url, samples, t0, stop, streaming))

        async def one(prompt: str) -> None:
            nonlocal tokens
            async with gate:
                r = await _stream_one(client, w, prompt, t0, streaming)
            results.append(r)
            tokens += r.output_tokens
            if progress:
                progress(len(results), w.requests, tokens)

        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
        stop.set()
        await sampler
    return results, samples, wall


def summarize(
    w: Workload, results: list[RequestResult], samples: list[tuple[float, int]], wall_s: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    itl = [x for r in ok for x in r.itls_s]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    running = [n for _, n in samples]
    reasons = []
    failed = len(results) - len(ok)
    if failed:
        reasons.append(f"{failed} of {len(results)} requests failed")
    short = [r for r in ok if r.output_tokens < w.output_tokens]
    if w.ignore_eos and short:
        reasons.append(
            f"{len(short)} answers were shorter than {w.output_tokens} tokens "
            "(ignore_eos not honoured?)"
        )
    if not running:
        reasons.append("the runtime's metrics could not be sampled, so concurrency is not proven")
    elif max(running) < w.concurrency:
        reasons.append(
            f"only {max(running)} of {w.concurrency} requests ran at once "
            "(the runtime's own metrics)"
        )
    med_tpot = statistics.median(tpot) if tpot else None
    valid = not reasons and med_tpot is not None

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 3)

    return {
        "requests": len(results),
        "succeeded": len(ok),
        "wall_s": round(wall_s, 3),
        "ttft_ms": {"median": ms(percentile(ttft, 0.5)), "p99": ms(percentile(ttft, 0.99))},
        "tpot_ms": {"median": ms(percentile(tpot, 0.5)), "p99": ms(percentile(tpot, 0.99))},
        "itl_ms": {"median": ms(percentile(itl, 0.5)), "p99": ms(percentile(itl, 0.99))},
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "output_tokens_per_s": round(out_tokens / wall_s, 2) if wall_s else None,
        "total_tokens_per_s": round((out_tokens + in_tokens) / wall_s, 2) if wall_s else None,
        "running_at_once": {
            "max": max(running) if running else None,
            "median": statistics.median(running) if running else None,
            "samples": len(running),
        },
        "generation_tokens_per_s": round(w.concurrency / med_tpot, 2)
        if valid and med_tpot
        else None,
        "valid": valid,
        "invalid_because": reasons,
    }


def result_document(
    w: Workload,
    results: list[RequestResult],
    samples: list[tuple[float, int]],
    wall_s: float,
    runtime: dict[str, Any],
) -> dict[str, Any]:
    workload = asdict(w)
    workload.pop("api_key")
    return {
        "workload": workload,
        "runtime": runtime,
        "summary": summarize(w, results, samples, wall_s),
        "samples": [{"t_s": t, "running": n} for t, n in samples],
        "requests": [
            {
                "ok": r.ok,
                "error": r.error,
                "start_s": round(r.start_s, 4),
                "ttft_s": r.ttft_s,
                "latency_s": r.latency_s,
                "output_tokens": r.output_tokens,
                "prompt_tokens": r.prompt_tokens,
            }
            for r in results
        ],
    }


def make_prompts(runtime_url: str, engine: str, model: str, w: Workload) -> list[str]:
    """Random-token prompts of exactly `input_tokens` tokens, made with the runtime's tokenizer.

    Random ids decode to text that may tokenize to a different length, so the text is
    re-tokenized, cut to the length and decoded again.
    """
    rng = random.Random(w.seed)
    prompts = []
    with httpx.Client(base_url=runtime_url, timeout=30) as client:
        for _ in range(w.requests):
            ids = random_token_ids(rng, 20000, w.input_tokens)
            for _attempt in range(3):
                text = _detokenize(client, engine, model, ids)
                ids = _tokenize(client, engine, model, text)
                if len(ids) >= w.input_tokens:
                    ids = ids[: w.input_tokens]
                else:
                    ids += random_token_ids(rng, 20000, w.input_tokens - len(ids))
            prompts.append(_detokenize(client, engine, model, ids))
    return prompts


def _tokenize(client: httpx.Client, engine: str, model: str, text: str) -> list[int]:
    if engine == "llamacpp":
        r = client.post("/tokenize", json={"content": text, "add_special": False})
    else:
        r = client.post(
            "/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False}
        )
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


def _detokenize(client: httpx.Client, engine: str, model: str, ids: list[int]) -> str:
    if engine == "llamacpp":
        r = client.post("/detokenize", json={"tokens": ids})
        r.raise_for_status()
        return str(r.json()["content"])
    r = client.post("/detokenize", json={"model": model, "tokens": ids})
    r.raise_for_status()
    return str(r.json()["prompt"])


def target(
    load_config: Callable[[], Config], scope: Scope, o: Mapping[str, Any]
) -> tuple[Workload, str, str, dict[str, Any]]:
    """`b70ctl bench`'s workload, the runtime's URL and metrics, and which runtime serves: from
    the options, and from the config and systemd for what they leave out."""
    from appliance.units import runtimes

    runtime: dict[str, Any] = {
        "name": None,
        "engine": o["engine"],
        "unit": None,
        "invocation_id": None,
    }
    config = None
    if not (o["url"] and o["model"] and o["runtime_url"] and o["engine"]):
        config = load_config()
    url = o["url"] or runtimes.proxy_url(config)  # type: ignore[arg-type]
    runtime_url = o["runtime_url"] or runtimes.backend_url(config)  # type: ignore[arg-type]
    key = o["api_key"]
    if config is not None:
        from appliance.keys import read_key
        from appliance.layout import layout
        from appliance.units import serving as units
        from appliance.units import systemd

        key = key or read_key(layout(scope))
        with systemd.connect(scope) as sd:
            name = units.require_serving(config, sd)
            rt = config.runtimes[name]
            runtime = {
                "name": name,
                "engine": rt.engine.value,
                "unit": rt.unit,
                "invocation_id": sd.properties(rt.unit).invocation_id,
            }
        runtime["engine"] = o["engine"] or runtime["engine"]
    w = Workload(
        url=url,
        model=o["model"] or (config.proxy.model if config else ""),
        api_key=key or "none",
        requests=o["n_requests"],
        concurrency=o["concurrency"],
        input_tokens=o["input_tokens"],
        output_tokens=o["output_tokens"],
        seed=o["seed"],
    )
    return w, runtime_url, runtime_url + "/metrics", runtime
