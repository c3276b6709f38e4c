"""`b70ctl plan` beside the start-up logs B70 owners published: vLLM's own flags in, vLLM's own
lines out. Each case names its public source; the geometries in fixtures/b70/ were rebuilt from
public excerpts (`"_verbatim": false` in each file says which)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance.cli import cli
from b70tools.b70logs import GIB, LOGS, RELEASES, WEIGHTS

B70 = Path(__file__).parent / "fixtures" / "b70"


def plan(config: str, *args: str) -> dict[str, object]:
    out = CliRunner().invoke(cli, ["plan", str(B70 / f"{config}.json"), *args, "--json"])
    assert out.exit_code == 0, out.output + out.stderr
    result: dict[str, object] = json.loads(out.output)["result"]
    return result


@pytest.mark.parametrize("case", LOGS, ids=[c[0] for c in LOGS])
def test_the_plan_given_the_logged_cache_prints_what_vllm_printed(case: tuple) -> None:  # type: ignore[type-arg]
    name, config, flags, available, tokens, concurrency, block, padding, source = case
    doc = plan(config, *flags, "--kv-cache-gib", str(available), "--vllm-version", RELEASES[name])
    assert doc["kv_cache_tokens"] == pytest.approx(tokens, rel=0.01), source
    if concurrency is not None:
        # L1 is 0.15 apart: the planned 708 blocks of 17.98 GiB against the 706 that 54.31x
        # and 444,888 tokens both say vLLM made (two cards, the smaller one's count wins).
        assert doc["max_concurrency"] == pytest.approx(
            concurrency, abs=0.02 if name != "L1" else 0.2
        )
    if block is not None:
        assert doc["block_size"] == block
        log = "\n".join(doc["log"])  # type: ignore[arg-type]
        assert f"Setting attention block size to {block} tokens" in log
        assert f"Padding mamba page size by {padding}%" in log
        assert f"GPU KV cache size: {doc['kv_cache_tokens']:,} tokens" in log


WEIGHED = [c for c in LOGS if c[0] in WEIGHTS]


@pytest.mark.parametrize("case", WEIGHED, ids=[c[0] for c in WEIGHED])
def test_the_cache_from_the_flags_and_the_logged_weights_is_within_5_percent(case: tuple) -> None:  # type: ignore[type-arg]
    """Without the logged cache: vLLM's share of the card as the log's release takes it, less
    the weights the log states and what the profile keeps back, is the cache vLLM logged,
    within 5%, and inside the range the plan gives."""
    name, config, flags, available, *_, source = case
    doc = plan(
        config, *flags, "--weights-gib", str(WEIGHTS[name]), "--vllm-version", RELEASES[name]
    )
    assert doc["available_kv_bytes"] / GIB == pytest.approx(available, rel=0.05), source
    budget = doc["budget"]
    assert budget["least"] <= available * GIB <= budget["most"]  # type: ignore[index]


@pytest.mark.parametrize("name", ["L1", "L11"])
def test_the_cache_from_the_flags_alone_is_within_5_percent_where_the_weights_are_known(
    name: str,
) -> None:
    """Where the checkpoint's weights are planned right (int4 AutoRound; FP8 from BF16, with the
    vision tower L11 loads and L1's `--limit-mm-per-prompt` of 0 leaves out), the flags alone
    give the cache within 5%."""
    _, config, flags, available, *_, source = next(c for c in LOGS if c[0] == name)
    doc = plan(config, *flags, "--vllm-version", RELEASES[name])
    assert doc["weight_bytes_per_card"] / GIB == pytest.approx(WEIGHTS[name], rel=0.03), source
    assert doc["available_kv_bytes"] / GIB == pytest.approx(available, rel=0.05), source


def test_l19_at_vllm_s_defaults_leaves_no_cache_and_the_range_holds_what_it_logged() -> None:
    """intel/llm-scaler#672: Qwen3.8-27B in BF16 on two B70s, in a 0.26 image, logged
    "Available KV cache memory: -0.61 GiB". Its flags beyond the two cards were not given; at
    vLLM's defaults (0.92, 256 sequences, the vision tower loaded) the older rule leaves none,
    and the range of the 0.26 plan, which holds both rules, holds the logged figure."""
    older = plan("Qwen-Qwen3.8-27B", "--tensor-parallel-size", "2", "--vllm-version", "0.24")
    assert older["available_kv_bytes"] / GIB == pytest.approx(-0.61, abs=0.3)  # type: ignore[operator]
    assert older["fits"] is False
    newer = plan("Qwen-Qwen3.8-27B", "--tensor-parallel-size", "2", "--vllm-version", "0.26")
    budget = newer["budget"]
    assert budget["least"] <= -0.61 * GIB <= budget["most"]  # type: ignore[index]


def test_a_media_limit_of_0_for_every_modality_leaves_the_vision_tower_out() -> None:
    base = ["--max-model-len", "8192"]
    tower = plan("Qwen-Qwen3.6-27B", *base)
    none = plan("Qwen-Qwen3.6-27B", *base, "--limit-mm-per-prompt", '{"image": 0, "video": 0}')
    only = plan("Qwen-Qwen3.6-27B", *base, "--language-model-only")
    some = plan("Qwen-Qwen3.6-27B", *base, '--limit-mm-per-prompt={"image": 1, "video": 0}')
    assert none["weight_bytes_per_card"] == only["weight_bytes_per_card"]
    assert tower["weight_bytes_per_card"] == some["weight_bytes_per_card"]
    tower_gib = (tower["weight_bytes_per_card"] - none["weight_bytes_per_card"]) / GIB  # type: ignore[operator]
    assert 0.75 < tower_gib < 0.95  # 27 blocks of 1152 wide and the merger, in bf16
    bad = CliRunner().invoke(cli, ["plan", str(B70 / "Qwen-Qwen3.6-27B.json"),
                                   "--limit-mm-per-prompt", "image=0"])  # fmt: skip
    assert (
        bad.exit_code == 1 and "--limit-mm-per-prompt 'image=0' is not a JSON object" in bad.stderr
    )
    assert "Traceback" not in bad.output + bad.stderr


def test_the_seed_recipe_holds_61_requests_with_the_fp32_state_and_64_with_fp16() -> None:
    """The B70 recipe of examples/b70.toml: its fp32 GDN state filled the cache at 61 requests
    of 1024 tokens on one B70; fp16 served all 64."""
    recipe = ["--quantization", "gptq", "--dtype", "float16", "--kv-cache-dtype", "fp8",
              "--max-model-len", "16384", "--gpu-memory-utilization", "0.82", "--max-num-seqs",
              "64", "--max-num-batched-tokens", "8192", "--language-model-only",
              "--cpu-offload-gb", "4", "--cpu-offload-params", "embed_tokens",
              "--no-enable-prefix-caching", "--tokens", "1024"]  # fmt: skip
    fp32 = plan("Qwen-Qwen3.6-35B-A3B", *recipe)
    fp16 = plan("Qwen-Qwen3.6-35B-A3B", *recipe, "--mamba-ssm-cache-dtype", "float16")
    assert 60 <= fp32["requests_fit"] <= 62  # type: ignore[operator]
    assert fp16["requests_fit"] >= 64  # type: ignore[operator]


def test_a_recipe_that_cannot_hold_one_request_says_so_as_vllm_would_and_how_to_fit() -> None:
    """L16's first run: MTP4 at 100,000 tokens with prefix caching (vLLM's default, the mamba
    `align` mode) needs 4.26 GiB, and 4.25 were pinned (issue #4 of SergiioB's cookbook)."""
    flags = [f for f in LOGS[5][2] if f != "--no-enable-prefix-caching"]
    doc = plan("Qwen-Qwen3.8-27B", *flags)
    assert doc["fits"] is False
    assert any(
        "(4.26 GiB KV cache is needed, which is larger than the available KV cache "
        "memory (4.25 GiB)" in line
        for line in doc["log"]
    )  # type: ignore[union-attr]
    assert doc["longest_len"] < 100_000  # type: ignore[operator]
    assert "--max-model-len" in doc["fix"]  # type: ignore[operator]
    longest = plan(
        "Qwen-Qwen3.8-27B", *[str(doc["longest_len"]) if f == "100000" else f for f in flags]
    )
    assert longest["fits"] is True


def test_every_vllm_flag_is_taken_as_vllm_spells_it() -> None:
    same = plan("Qwen-Qwen3.6-35B-A3B", "--max-model-len=16k", "--tensor_parallel_size", "1",
                "--max-num-seqs=64", "--compilation-config", '{"level": 3}', "--port", "8001")  # fmt: skip
    spelled = plan("Qwen-Qwen3.6-35B-A3B", "--max-model-len", "16000", "--max-num-seqs", "64")
    assert same["max_model_len"] == spelled["max_model_len"] == 16000
    assert same["ignored_flags"] == ["--compilation-config", "--port"]
    bad = CliRunner().invoke(cli, ["plan", str(B70 / "Qwen-Qwen3.6-27B.json"),
                                   "--gpu-memory-utilization", "1.3"])  # fmt: skip
    assert (
        bad.exit_code == 1
        and "--gpu-memory-utilization '1.3' is not a number in (0, 1]" in bad.stderr
    )
    assert "Traceback" not in bad.output + bad.stderr
