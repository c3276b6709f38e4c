"""`b70ctl bench` and `b70ctl gate`: pure parts on data, the rest on the real appliance."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from appliance.host import health, runtime_http
from appliance.measure import bench, gate
from b70tools import stream_source
from b70tools.net import free_port
from tests.conftest import Appliance

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 7.0
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 3.0
"""
LLAMA_METRICS = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
llamacpp:requests_deferred 5
"""


def test_running_requests_from_each_engines_metrics() -> None:
    assert bench.parse_running(VLLM_METRICS) == 7
    assert bench.parse_running(LLAMA_METRICS) == 2
    assert bench.parse_running("# nothing here\nother_metric 4\n") is None


# What a vLLM's /metrics looks like, in prometheus-client's own words: HELP and TYPE lines, a
# counter written with its `_total`, its `_created` gauge, a histogram.
VLLM_FULL = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 2.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="smollm2"} 640.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="smollm2"} 1.7e+09
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="smollm2"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="smollm2"} 3.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="smollm2"} 3.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="smollm2"} 1.5
"""


def test_a_timestamp_after_the_value_is_not_the_value() -> None:
    text = (
        'vllm:num_requests_running{model_name="smollm2"} 3 1700000000000\n'
        'vllm:num_requests_waiting{model_name="smollm2"} 2 1700000000000\n'
        "llamacpp:tokens_predicted_total 40 1700000000000\n"
    )
    assert bench.parse_running(text) == 3
    assert runtime_http.parse_in_flight(text) == 5
    assert runtime_http.metric_sum(text, runtime_http.GENERATED_METRICS) == 40


def test_label_values_with_escaped_quotes_and_commas_are_one_label() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="say \\"a, b\\"} 9"} 2 1700000000000\n'
        'vllm:num_requests_running{engine="1",model_name="c\\\\d,e=f"} 3\n'
    )
    assert runtime_http.metric_sum(text, runtime_http.RUNNING_METRICS) == 5
    read = runtime_http.samples(text)
    assert read is not None
    assert [s.labels["model_name"] for s in read] == ['say "a, b"} 9', "c\\d,e=f"]


def test_nan_and_inf_are_no_count() -> None:
    for value in ("NaN", "+Inf", "-Inf"):
        text = f"vllm:num_requests_running {value}\nllamacpp:tokens_predicted_total {value}\n"
        assert runtime_http.parse_in_flight(text) is None, value
        assert bench.parse_running(text) is None, value
        assert runtime_http.metric_sum(text, runtime_http.GENERATED_METRICS) is None, value
    # finite samples whose sum is not
    huge = "vllm:num_requests_running 1e308\nvllm:num_requests_waiting 1e308\n"
    assert runtime_http.parse_in_flight(huge) is None
    # a histogram's le="+Inf" is a label, not a value
    assert runtime_http.metric_sum(VLLM_FULL, ("vllm:e2e_request_latency_seconds_bucket",)) == 4


def test_help_and_type_lines_and_the_names_the_parser_gives_samples() -> None:
    """Families of counters drop `_total`, their samples keep it; a histogram's samples are
    `_bucket`, `_sum` and `_count`; so the runtimes' metrics are found by the samples' names."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(VLLM_FULL)}
    assert "vllm:generation_tokens" in families and "vllm:generation_tokens_total" not in families
    assert [s.name for s in families["vllm:generation_tokens"].samples] == [
        "vllm:generation_tokens_total"
    ]
    assert {s.name for s in families["vllm:e2e_request_latency_seconds"].samples} == {
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_sum",
    }
    assert runtime_http.metric_sum(VLLM_FULL, runtime_http.GENERATED_METRICS) == 640
    assert runtime_http.parse_in_flight(VLLM_FULL) == 2
    assert runtime_http.metric_sum(VLLM_FULL, ("vllm:e2e_request_latency_seconds",)) is None
    assert runtime_http.metric_sum(VLLM_FULL, ("vllm:e2e_request_latency_seconds_count",)) == 3
    # a counter typed without `_total` gets it on its samples: llama-server's name still matches
    counter = "# TYPE llamacpp:tokens_predicted counter\nllamacpp:tokens_predicted 7\n"
    assert runtime_http.metric_sum(counter, runtime_http.GENERATED_METRICS) == 7


@pytest.mark.parametrize(
    "text",
    ["llamacpp:requests_processing 2\nthis is not a sample\n",
     "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1_0\n",
     'llamacpp:requests_processing 2\nvllm:num_requests_waiting{engine="0 3\n',
     "llamacpp:requests_processing 2\n# TYPE llamacpp:requests_deferred\n",
     "llamacpp:requests_processing 2\n\x00\xff\n"],
)  # fmt: skip
def test_a_malformed_document_counts_nothing(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One bad line and the whole document is not trusted: a count from part of it could say
    a runtime is idle while it is not."""
    assert runtime_http.parse_in_flight(text) is None and bench.parse_running(text) is None
    assert runtime_http.samples(text) is None
    monkeypatch.setattr(health, "request", lambda *a, **k: health.Answer(200, text.encode()))
    assert health.read_work("http://127.0.0.1:1") == (None, None)


def test_a_runtimes_nan_metrics_are_no_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "llamacpp:requests_processing nan\nllamacpp:tokens_predicted_total 12\n"
    monkeypatch.setattr(health, "request", lambda *a, **k: health.Answer(200, text.encode()))
    assert health.read_work("http://127.0.0.1:1") == (None, 12)


def test_percentiles() -> None:
    assert bench.percentile([1, 2, 3, 4], 0.5) == 2.5
    assert bench.percentile([5], 0.99) == 5
    assert bench.percentile([], 0.5) is None


def result(tokens: int = 16, ok: bool = True) -> bench.RequestResult:
    return bench.RequestResult(
        ok=ok,
        ttft_s=0.1,
        latency_s=0.1 + 0.02 * (tokens - 1),
        output_tokens=tokens,
        prompt_tokens=32,
        itls_s=[0.02] * (tokens - 1),
    )


def test_the_generation_figure_needs_the_concurrency_proven() -> None:
    w = bench.Workload(url="u", model="m", api_key="k", requests=4, concurrency=4, output_tokens=16)
    proven = bench.summarize(w, [result() for _ in range(4)], [(0.1, 4), (0.3, 4)], 1.0)
    assert proven["valid"] and proven["generation_tokens_per_s"] == pytest.approx(4 / 0.02)
    assert proven["tpot_ms"]["median"] == pytest.approx(20.0)
    short = bench.summarize(w, [result() for _ in range(4)], [(0.1, 2), (0.3, 3)], 1.0)
    assert not short["valid"] and short["generation_tokens_per_s"] is None
    assert short["invalid_because"] == [
        "only 3 of 4 requests ran at once (the runtime's own metrics)"
    ]
    unsampled = bench.summarize(w, [result() for _ in range(4)], [], 1.0)
    assert unsampled["invalid_because"] == [
        "the runtime's metrics could not be sampled, so concurrency is not proven"
    ]
    eos = bench.summarize(w, [result(10), *[result() for _ in range(3)]], [(0.1, 4)], 1.0)
    assert eos["invalid_because"] == [
        "1 answers were shorter than 16 tokens (ignore_eos not honoured?)"
    ]


def test_the_runtime_is_sampled_when_every_stream_is_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers shorter than the sampling period still prove their concurrency: the metrics are
    read when the client has all C streams between first token and end, not only on the clock."""
    monkeypatch.setattr(bench, "SAMPLE_EVERY_S", 60.0)
    port = free_port()
    w = bench.Workload(
        url=f"http://127.0.0.1:{port}",
        model="m",
        api_key="k",
        requests=6,
        concurrency=3,
        output_tokens=6,
    )

    async def measure() -> tuple[list[bench.RequestResult], list[tuple[float, int]], float]:
        source = stream_source.Source(per_write=1, stream_tokens_per_s=100)
        server = await asyncio.start_server(source.handle, "127.0.0.1", port)
        async with server:
            return await bench.run(w, ["p"] * 6, f"http://127.0.0.1:{port}/metrics")

    results, samples, wall = asyncio.run(measure())
    assert wall < 5 and [r.output_tokens for r in results] == [6] * 6
    # one reading on the clock (its period is 60 s), the others when all three streamed
    assert 2 <= len(samples) <= 1 + 6 and max(n for _, n in samples) == 3
    # a reading of three comes once the third stream had its first token (times kept to 1 ms)
    third = sorted(r.start_s + (r.ttft_s or 0) for r in results)[2]
    assert all(t >= third - 0.001 for t, n in samples if n == 3)
    assert bench.summarize(w, results, samples, wall)["valid"]


def test_schema_errors() -> None:
    good = {"city": "Oslo", "country": "Norway", "population": 700000, "is_capital": True}
    assert gate.schema_errors(good, gate.CITY_SCHEMA) == []
    bad = {"city": "Oslo", "population": "many", "is_capital": 1, "extra": 0}
    assert gate.schema_errors(bad, gate.CITY_SCHEMA) == [
        "$.country is missing",
        "$.extra is not allowed",
        "$.population is str, not integer",
        "$.is_capital is int, not boolean",
    ]
    assert gate.schema_errors([], gate.CITY_SCHEMA) == ["$ is list, not object"]


# --- on the real appliance (llama-server with 2 slots, vLLM, the proxy) ------------------------


def test_bench_through_the_proxy_writes_a_valid_result(
    appliance: Appliance, tmp_path: Path
) -> None:
    appliance.b70ctl("switch", "llamacpp", check=True)
    out_file = tmp_path / "bench.json"
    out = appliance.b70ctl(
        "bench",
        "--requests",
        "6",
        "--concurrency",
        "2",
        "--input-tokens",
        "48",
        "--output-tokens",
        "24",
        "--out",
        str(out_file),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)["result"]
    doc = json.loads(out_file.read_text())
    assert summary["valid"], (summary["invalid_because"], doc["samples"], doc["requests"])
    assert summary["running_at_once"]["max"] == 2
    assert summary["generation_tokens_per_s"] > 0
    assert "api_key" not in doc["workload"] and doc["workload"]["concurrency"] == 2
    invocation = appliance.manager.systemctl(
        "show", "-p", "InvocationID", "--value", "b70-llamacpp.service"
    ).strip()
    assert doc["runtime"] == {
        "name": "llamacpp",
        "engine": "llamacpp",
        "unit": "b70-llamacpp.service",
        "invocation_id": invocation,
    }
    assert [r["output_tokens"] for r in doc["requests"]] == [24] * 6
    assert [r["prompt_tokens"] for r in doc["requests"]] == [48] * 6
    assert doc["samples"] and all(s["running"] <= 2 for s in doc["samples"])


def test_bench_refuses_the_figure_when_concurrency_was_not_reached(
    appliance: Appliance, tmp_path: Path
) -> None:
    appliance.b70ctl("switch", "llamacpp", check=True)
    out = appliance.b70ctl(
        "bench",
        "--requests",
        "8",
        "--concurrency",
        "4",
        "--input-tokens",
        "16",
        "--output-tokens",
        "16",
        "--out",
        str(tmp_path / "b.json"),
    )
    assert out.returncode == 0, out.stderr
    assert (
        "generation       INVALID: only 2 of 4 requests ran at once (the runtime's own metrics)"
        in out.stdout
    )


def test_gate_records_then_checks_canaries(appliance: Appliance) -> None:
    appliance.b70ctl("switch", "llamacpp", check=True)
    first = appliance.b70ctl("gate", "--record")
    assert first.returncode == 0, first.stderr
    assert "ok   json-mode: 4 of 4 replies matched the schema" in first.stdout
    assert "ok   canaries: recorded 3 greedy answers for llamacpp" in first.stdout
    again = appliance.b70ctl("gate")
    assert again.returncode == 0 and "ok   canaries: 3 of 3 answers as recorded" in again.stdout
    canaries = Path(appliance.manager.env["XDG_STATE_HOME"]) / "b70" / "canaries.json"
    known = json.loads(canaries.read_text())
    known["llamacpp"][gate.CANARIES[0]] = "Lyon."
    canaries.write_text(json.dumps(known))
    tampered = appliance.b70ctl("gate")
    assert tampered.returncode == 1
    assert "FAIL canaries: 1 of 3 answers changed" in tampered.stdout
    assert "recorded 'Lyon.'" in tampered.stdout
    assert "error: llamacpp failed the validity gates: canaries:" in tampered.stderr
    assert appliance.b70ctl("gate", "--record").returncode == 0


def test_switch_with_gate_rolls_back_when_a_gate_fails(appliance: Appliance) -> None:
    appliance.b70ctl("switch", "llamacpp", check=True)
    canaries = Path(appliance.manager.env["XDG_STATE_HOME"]) / "b70" / "canaries.json"
    known = json.loads(canaries.read_text()) if canaries.exists() else {}
    known["llamacpp-b"] = {p: "an answer it will not give" for p in gate.CANARIES}
    canaries.write_text(json.dumps(known))
    out = appliance.b70ctl("switch", "llamacpp-b", "--gate")
    assert out.returncode == 1
    assert (
        "switch to llamacpp-b failed: llamacpp-b failed the validity gates: canaries: "
        "3 of 3 answers changed"
    ) in out.stderr
    assert "rolled back: llamacpp is serving again" in out.stderr
    assert appliance.json("status")["result"]["active_runtime"] == "llamacpp"


def test_a_benchmark_stopped_by_sigterm_unwinds_as_on_ctrl_c(tmp_path: Path) -> None:
    """b70tools.demo_appliance.term_as_exit, around every benchmark's demo appliance: `kill` or
    `timeout` raises SystemExit in the block, so its cleanup (uninstall, the private manager
    stopped) runs, where before the process died and left them."""
    import signal
    import subprocess
    import sys

    marker = tmp_path / "cleaned"
    script = (
        "import sys, time\n"
        "from b70tools.demo_appliance import term_as_exit\n"
        "with term_as_exit():\n"
        "    try:\n"
        "        print('ready', flush=True)\n"
        "        time.sleep(60)\n"
        "    finally:\n"
        f"        open({str(marker)!r}, 'w').write('yes')\n"
    )
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert marker.read_text() == "yes"
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
