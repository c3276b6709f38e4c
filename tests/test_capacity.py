"""`b70ctl plan`: the capacity math, checked against hand calculations and the B70 recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance import capacity
from appliance.cli import cli
from appliance.errors import ApplianceError

HYBRID = Path(__file__).parent / "fixtures" / "hybrid-moe-config.json"
MIB = 1024**2


def cfg() -> dict[str, object]:
    data: dict[str, object] = json.loads(HYBRID.read_text())
    return data


def test_the_b70_recipe_gdn_state_is_60_mib_in_fp32_and_half_in_fp16() -> None:
    shape = capacity.parse_shape(cfg())
    assert (shape.linear_layers, shape.lin_v_heads, shape.lin_k_dim, shape.lin_v_dim) == (
        30,
        32,
        128,
        128,
    )
    assert capacity.gdn_state_bytes(shape, "fp32") == 60 * MIB
    assert capacity.gdn_state_bytes(shape, "fp16") == 30 * MIB


def test_layer_types_list_and_interval_agree() -> None:
    listed = dict(cfg())
    del listed["full_attention_interval"]
    listed["layer_types"] = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)
    ]
    assert capacity.parse_shape(listed) == capacity.parse_shape(cfg())


def test_kv_cache_per_token_counts_only_full_attention_layers() -> None:
    shape = capacity.parse_shape(cfg())
    assert shape.full_layers == 10
    assert capacity.kv_bytes_per_token(shape, "fp8") == 2 * 2 * 256 * 10 * 1
    assert capacity.kv_bytes_per_token(shape, "bf16") == 2 * 2 * 256 * 10 * 2


def test_parameter_count_by_hand() -> None:
    p = capacity.count_params(capacity.parse_shape(cfg()))
    h, v = 2048, 248320
    attention = h * (16 * 256 * 2) + 2 * h * 2 * 256 + 16 * 256 * h
    key_dim, value_dim = 16 * 128, 32 * 128
    gdn = (
        h * (2 * key_dim + 2 * value_dim)
        + h * 2 * 32
        + (2 * key_dim + value_dim) * 4
        + value_dim * h
    )
    assert p.embed == p.lm_head == v * h
    assert p.attention == 10 * attention
    assert p.linear == 30 * gdn
    assert p.experts == 40 * 256 * 3 * h * 512
    assert p.always == 40 * (3 * h * 512 + h * 256 + h)


def test_quantized_weights_and_what_fits() -> None:
    c = cfg()
    common = {
        "dtype": "fp16",
        "kv_dtype": "fp8",
        "utilization": 0.82,
        "tokens": 1024,
        "cpu_offload_bytes": 4 * 1024**3,
    }
    fp32 = capacity.plan(c, quant="gptq-int4", state_dtype="fp32", **common)
    fp16 = capacity.plan(c, quant="gptq-int4", state_dtype="fp16", **common)
    dense = capacity.plan(c, quant="none", state_dtype="fp16", **common)
    assert fp32.weight_bytes == fp16.weight_bytes < dense.weight_bytes
    assert fp32.request_bytes - fp16.request_bytes == 30 * MIB
    assert fp16.requests_fit > fp32.requests_fit
    assert fp32.requests_fit == fp32.budget_bytes // fp32.request_bytes
    assert dense.budget_bytes < fp16.budget_bytes


def test_decode_step_is_memory_bound_and_batching_helps() -> None:
    result = capacity.plan(
        cfg(), quant="gptq-int4", kv_dtype="fp8", state_dtype="fp16", batches=(1, 64)
    )
    one, many = result.steps
    assert one["step_ms"] == pytest.approx(one["bytes_read"] / 608e9 * 1000)
    assert many["bytes_read"] > one["bytes_read"]
    # 64 requests share one read of the weights: far more tokens per second than one request.
    assert many["tokens_per_s"] > 4 * one["tokens_per_s"]


def test_expected_distinct_experts() -> None:
    assert capacity.distinct_experts(256, 8, 1) == pytest.approx(8)
    assert capacity.distinct_experts(256, 8, 10_000) == pytest.approx(256)


def test_unknown_choices_are_named() -> None:
    with pytest.raises(ApplianceError, match="unknown quantization 'awq'"):
        capacity.plan(cfg(), quant="awq")
    broken = dict(cfg())
    del broken["num_hidden_layers"]
    with pytest.raises(ApplianceError, match=r"config\.json: num_hidden_layers is missing"):
        capacity.plan(broken)


def test_plan_command(tmp_path: Path) -> None:
    args = [
        "plan",
        str(HYBRID),
        "--quantization",
        "gptq-int4",
        "--kv-dtype",
        "fp8",
        "--state-dtype",
        "fp32",
    ]
    human = CliRunner().invoke(cli, args)
    assert human.exit_code == 0, human.output
    assert "GDN state per request  60.0 MiB" in human.output
    doc = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
    assert doc["ok"] and doc["result"]["gdn_state_bytes"] == 60 * MIB
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    out = CliRunner().invoke(cli, ["plan", str(bad)])
    assert out.exit_code == 1
    assert f"error: {bad}: not a readable JSON file" in out.stderr
