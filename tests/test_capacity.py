"""`b70ctl plan`: the capacity math, checked against hand calculations and the B70 recipe."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance import GIB
from appliance.cli import cli
from appliance.errors import ApplianceError
from appliance.measure import capacity, serveflags
from appliance.measure.memory import budget, paging
from appliance.measure.memory import shape as model_shape

HYBRID = Path(__file__).parent / "fixtures" / "hybrid-moe-config.json"
MIB = 1024**2


def cfg() -> dict[str, object]:
    data: dict[str, object] = json.loads(HYBRID.read_text())
    return data


def test_the_b70_recipe_gdn_state_is_60_mib_in_fp32_and_half_in_fp16() -> None:
    shape = model_shape.parse_shape(cfg())
    assert (shape.linear_layers, shape.lin_v_heads, shape.lin_k_dim, shape.lin_v_dim) == (
        30,
        32,
        128,
        128,
    )
    assert model_shape.gdn_state_bytes(shape, "fp32") == 60 * MIB
    assert model_shape.gdn_state_bytes(shape, "fp16") == 30 * MIB


def test_layer_types_list_and_interval_agree() -> None:
    listed = dict(cfg())
    del listed["full_attention_interval"]
    listed["layer_types"] = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)
    ]
    assert model_shape.parse_shape(listed) == model_shape.parse_shape(cfg())


def test_kv_cache_per_token_counts_only_full_attention_layers() -> None:
    shape = model_shape.parse_shape(cfg())
    assert shape.full_layers == 10
    assert model_shape.kv_bytes_per_token(shape, "fp8") == 2 * 2 * 256 * 10 * 1
    assert model_shape.kv_bytes_per_token(shape, "bf16") == 2 * 2 * 256 * 10 * 2


def test_parameter_count_by_hand() -> None:
    p = model_shape.count_params(model_shape.parse_shape(cfg()))
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
    assert p.always == 40 * 3 * h * 512
    assert p.router == 40 * (h * 256 + h)


def test_expected_distinct_experts() -> None:
    assert capacity.distinct_experts(256, 8, 1) == pytest.approx(8)
    assert capacity.distinct_experts(256, 8, 10_000) == pytest.approx(256)


# --- vLLM's layout of the cache (appliance.measure.memory.paging) ------------------------------------------------

# Qwen3-Next-80B-A3B's shape: 48 layers, every 4th full attention.
NEXT_80B = {**cfg(), "num_hidden_layers": 48, "vocab_size": 151936}
FP8, FP16, FP32 = 1.0, 2.0, 4.0


def test_the_recipe_model_pads_no_state_at_16_and_asks_four_blocks_a_request() -> None:
    """By hand: an attention token is 2 KV heads x (256 + 256) x 1 byte (fp8) = 1 KiB a layer;
    a GDN layer's state is 3 x 8192 x 2 (conv, fp16) + 32 x 128 x 128 x 4 (fp32) = 2146304
    bytes, exactly 131 x 16 KiB: a block of 2096 tokens. 10 attention and 30 GDN layers make
    groups of 10: one attention group and three GDN groups, a block from each a request."""
    s = model_shape.parse_shape(cfg())
    g = paging.layout(s, cards=1, kv_bytes=FP8, conv_bytes=FP16, state_bytes=FP32, tokens=1024,
                      available_bytes=9 * 1024**3)  # fmt: skip
    assert (g.attention_bytes_per_token, g.state_bytes) == (1024, 2146304)
    assert (g.block_size, g.page_bytes, g.state_padding) == (2096, 2146304, 0.0)
    assert (g.group_size, g.attention_groups, g.state_groups) == (10, 1, 3)
    assert g.blocks_per_request == 4 and g.bytes_per_request == 4 * 10 * 2146304
    assert g.blocks == 9 * 1024**3 // 2146304 // 10 == 450
    assert g.requests_fit == (450 - 1) // 4 == 112
    longer = paging.layout(s, cards=1, kv_bytes=FP8, conv_bytes=FP16, state_bytes=FP32,
                           tokens=2097, available_bytes=9 * 1024**3)  # fmt: skip
    assert longer.blocks_per_request == 2 + 3, "a second attention block past 2096 tokens"
    xpu = paging.layout(s, cards=1, kv_bytes=FP8, conv_bytes=FP16, state_bytes=FP32,
                        tokens=1024, available_bytes=9 * 1024**3, align=64)  # fmt: skip
    assert xpu.block_size == 2112 and xpu.state_padding == pytest.approx(2112 / 2096 - 1)


@pytest.mark.parametrize(
    ("cards", "block", "padding"),
    [
        # vLLM's log in PR #37467 (Qwen3-Next on XPU, tensor parallel 4, fp32 recurrent state):
        # "Setting attention block size to 528 tokens ... Padding mamba page size by 0.76%".
        (4, 528, 0.0076),
        (1, 1056, 0.0076),
        (2, 1056, 0.0076),
    ],
)
def test_the_block_size_of_qwen3_next_follows_vllm(cards: int, block: int, padding: float) -> None:
    s = model_shape.parse_shape({**NEXT_80B, "num_hidden_layers": 48})
    g = paging.layout(s, cards=cards, kv_bytes=FP16, conv_bytes=FP16, state_bytes=FP32,
                      tokens=1024, available_bytes=8 * 1024**3)  # fmt: skip
    assert (s.full_layers, s.linear_layers) == (12, 36)
    assert g.block_size == block and g.state_padding == pytest.approx(padding, abs=5e-5)
    assert g.kv_heads_per_card == max(1, 2 // cards), "KV heads replicated past their count"
    assert (g.group_size, g.attention_groups, g.state_groups) == (12, 1, 3)


def test_groups_of_the_larger_count_when_the_counts_are_close() -> None:
    """vLLM groups by the larger layer count when it is under 1.5 times the smaller one."""
    s = model_shape.parse_shape({**cfg(), "num_hidden_layers": 20, "full_attention_interval": 2})
    g = paging.layout(s, cards=1, kv_bytes=FP8, conv_bytes=FP16, state_bytes=FP16, tokens=100,
                      available_bytes=1024**3)  # fmt: skip
    assert (s.full_layers, s.linear_layers) == (10, 10)
    assert (g.group_size, g.attention_groups, g.state_groups) == (10, 1, 1)
    s = model_shape.parse_shape({**cfg(), "layer_types": ["full_attention"] * 8 + [
        "linear_attention"] * 11, "num_hidden_layers": 19})  # fmt: skip
    g = paging.layout(s, cards=1, kv_bytes=FP8, conv_bytes=FP16, state_bytes=FP16, tokens=100,
                      available_bytes=1024**3)  # fmt: skip
    assert (g.group_size, g.attention_groups, g.state_groups) == (11, 1, 1)


def test_a_model_without_gdn_layers_has_blocks_of_the_alignment() -> None:
    dense = {k: v for k, v in cfg().items() if not k.startswith("linear_")}
    dense.pop("full_attention_interval")
    s = model_shape.parse_shape(dense)
    g = paging.layout(s, cards=1, kv_bytes=FP16, conv_bytes=FP16, state_bytes=FP32,
                      tokens=1000, available_bytes=1024**3)  # fmt: skip
    assert (g.block_size, g.group_size, g.state_groups) == (16, 40, 0)
    assert g.page_bytes == 16 * 2 * 2 * 256 * 2
    assert (
        g.blocks_per_request == 63 and g.requests_fit == (1024**3 // g.page_bytes // 40 - 1) // 63
    )


# vLLM 0.32's line, as its CPU build printed it for the demo's model (labels shortened).
CACHE_INFO = (
    'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",'
    'kv_cache_max_concurrency="22.75",kv_cache_memory_bytes="1073741824",'
    'kv_cache_size_tokens="46592",mamba_block_size="None",num_gpu_blocks="364",'
    'prefix_caching_hash_algo="sha256"} 1.0'
)


def test_the_cache_vllm_reports_is_read_from_its_info_gauge() -> None:
    from appliance.measure import measured

    text = "# HELP vllm:cache_config_info x\n# TYPE vllm:cache_config_info gauge\n" + CACHE_INFO
    labels = measured.cache_info(text)
    assert labels["num_gpu_blocks"] == "364" and labels["block_size"] == "128"
    assert measured.number(labels, "mamba_block_size") is None
    with pytest.raises(ApplianceError, match="has no vllm:cache_config_info"):
        measured.cache_info("llamacpp:requests_processing 0\n")
    assert measured.max_model_len({"data": [{"id": "m", "max_model_len": 2048}]}) == 2048
    assert measured.max_model_len({"data": []}) is None


def test_cache_info_labels_are_unescaped_and_non_numbers_are_not_reported() -> None:
    from appliance.measure import measured

    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="fp8",kv_cache_max_concurrency="+Inf",'
        'model="a \\"b\\", c\\\\d",num_gpu_blocks="NaN"} 1.0 1700000000000\n'
    )
    labels = measured.cache_info(text)
    assert labels["model"] == 'a "b", c\\d' and labels["cache_dtype"] == "fp8"
    assert measured.number(labels, "block_size") == 16
    assert measured.number(labels, "kv_cache_max_concurrency") is None
    assert measured.number(labels, "num_gpu_blocks") is None


@pytest.mark.parametrize(
    "text",
    [CACHE_INFO + "\nthis is not a sample\n",
     'vllm:cache_config_info{block_size="16",num_gpu_blocks="364" 1.0\n',
     'vllm:cache_config_info{block_size="16"\n'],
)  # fmt: skip
def test_cache_info_from_a_malformed_document_is_a_clear_error(text: str) -> None:
    from appliance.measure import measured

    with pytest.raises(ApplianceError, match="is not Prometheus text") as raised:
        measured.cache_info(text)
    assert raised.value.code == "plan_compare_failed"


def test_plan_against_a_runtime_with_malformed_metrics_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from appliance.host import health

    base = "http://127.0.0.1:1"
    answers = {"/metrics": CACHE_INFO + "\nnot Prometheus\n", "/v1/models": '{"data": []}'}

    def request(method: str, url: str, *args: object, **kwargs: object) -> health.Answer:
        return health.Answer(200, answers[url.removeprefix(base)].encode())

    monkeypatch.setattr(health, "request", request)
    out = CliRunner().invoke(cli, ["plan", str(HYBRID), "--compare", base])
    assert out.exit_code == 1 and "Traceback" not in out.output + out.stderr
    assert "error: the runtime's /metrics is not Prometheus text" in out.stderr


def test_plan_against_an_address_where_nothing_answers_is_a_clear_error(tmp_path: Path) -> None:
    from b70tools.net import free_port

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "vocab_size": 100}))  # fmt: skip
    port = free_port()
    out = CliRunner().invoke(cli, ["plan", str(config), "--compare", f"http://127.0.0.1:{port}"])
    assert out.exit_code == 1 and "Traceback" not in out.output + out.stderr
    assert f"error: http://127.0.0.1:{port}: connection refused" in out.stderr
    assert "--compare takes a running vLLM's address" in out.stderr


def test_the_start_up_profile_peak_of_the_recipe_by_hand() -> None:
    """8192 tokens at once, 8 experts each (R = 65536 rows), hidden 2048, expert width 512, in
    fp16: regrouped rows 256 MiB, gate-up 128 MiB, activation 64 MiB, down 256 MiB, three
    8192 x 2048 copies 96 MiB; beside them the hidden states and the residual, 64 MiB. The MoE
    layer is the largest (a GDN layer's projections are 320 MiB). The sampler keeps three fp32
    rows of the 248,320-token vocabulary for each of 64 requests: 182 MiB."""
    s = model_shape.parse_shape(cfg())
    peak = budget.activation_bytes(s, 1, 8192, "fp16")
    assert peak == (256 + 128 + 64 + 256 + 96 + 64) * MIB
    assert budget.activation_bytes(s, 1, 0, "fp16") == 0
    two = budget.activation_bytes(s, 2, 8192, "fp16")
    assert two == (256 + 64 + 32 + 256 + 96 + 64) * MIB, "the experts' width splits over cards"
    assert budget.sampler_bytes(s, 64, 8192) == 64 * 248_320 * 4 * 3
    assert budget.sampler_bytes(s, 256, 16) == 16 * 248_320 * 4 * 3, "one request per token"


def serve(flags: str) -> serveflags.Serve:
    return serveflags.parse(flags.split())


RECIPE = (
    "--quantization gptq --dtype float16 --kv-cache-dtype fp8 --max-model-len 16384 "
    "--gpu-memory-utilization 0.82 --max-num-seqs 64 --max-num-batched-tokens 8192 "
    "--language-model-only --cpu-offload-gb 4 --cpu-offload-params embed_tokens "
    "--no-enable-prefix-caching"
)


def test_quantized_weights_and_what_fits() -> None:
    fp32 = capacity.plan(cfg(), serve(RECIPE + " --mamba-ssm-cache-dtype float32"), tokens=1024)
    fp16 = capacity.plan(cfg(), serve(RECIPE + " --mamba-ssm-cache-dtype float16"), tokens=1024)
    dense = capacity.plan(cfg(), serve(RECIPE.replace("--quantization gptq ", "")), tokens=1024)
    assert fp32.weight_bytes == fp16.weight_bytes < dense.weight_bytes
    assert fp32.request_bytes - fp16.request_bytes == 30 * MIB
    assert fp16.requests_fit > fp32.requests_fit
    # XPU rounds the block of 2096 tokens that holds the state up to 2112, a multiple of 64.
    assert fp32.block_size == 2112
    assert fp32.requests_fit == (fp32.available_kv_bytes // (2112 * 1024) // 10 - 1) // 4
    cuda = capacity.plan(cfg(), serve(RECIPE + " --mamba-ssm-cache-dtype float32"), block_align=16)
    assert cuda.block_size == 2096
    assert dense.available_kv_bytes < fp16.available_kv_bytes


def test_embed_tokens_offloads_nothing() -> None:
    """vLLM's --cpu-offload-params embed_tokens, as the B70 recipe says: vLLM offloads only the
    decoder layers' parameters, and the embedding is not among them, so the whole model stays on
    the card however large --cpu-offload-gb is."""
    everything = capacity.plan(
        cfg(), serve(RECIPE.replace(" --cpu-offload-params embed_tokens", ""))
    )
    embedding = capacity.plan(cfg(), serve(RECIPE))
    assert everything.cpu_offload_bytes == 4 * 1024**3 and embedding.cpu_offload_bytes == 0
    assert everything.available_kv_bytes - embedding.available_kv_bytes == 4 * 1024**3


def test_cards_split_the_weights_and_the_state() -> None:
    one = capacity.plan(cfg(), serve(RECIPE), tokens=1024)
    two = capacity.plan(cfg(), serve(RECIPE + " -tp 2"), tokens=1024)
    assert two.weight_bytes_per_card == one.weight_bytes // 2
    assert two.paging.state_bytes == one.paging.state_bytes // 2
    assert two.paging.kv_heads_per_card == 1 and two.requests_fit > 2 * one.requests_fit
    with pytest.raises(ApplianceError, match="linear_num_key_heads 16 does not split over 3 cards"):
        capacity.plan(cfg(), serve(RECIPE + " --tensor-parallel-size 3"))


def terms(p: capacity.Plan) -> dict[str, int]:
    return {t.key: t.bytes for t in p.budget.terms}


def test_the_budget_is_what_vllm_asks_for_less_each_term() -> None:
    """Every release: ceil(total x utilization), less each term the plan names; 0.31 takes a
    B70 at vLLM's getMemoryInfo total (30.30 GiB), 0.24 at torch's (31.89 GiB)."""
    for version, total in (("0.31", budget.GETMEMORYINFO_TOTAL), ("0.24", budget.TORCH_TOTAL)):
        p = capacity.plan(cfg(), serve(RECIPE), vllm_version=capacity.parse_version(version))
        assert p.budget.total == total
        assert p.budget.requested == math.ceil(total * 0.82)
        assert p.available_kv_bytes == p.budget.requested - sum(terms(p).values())
        assert p.budget.least < p.available_kv_bytes < p.budget.most
    fewer = capacity.plan(cfg(), serve(RECIPE.replace("8192", "2048")))
    kept = capacity.plan(cfg(), serve(RECIPE))
    more = fewer.available_kv_bytes - kept.available_kv_bytes
    assert more == terms(kept)["activations"] - terms(fewer)["activations"] > 0


def test_before_0_26_each_sequence_and_a_second_card_are_kept_as_the_logs_show() -> None:
    """The B70 logs' cache shrinks with --max-num-seqs (L10's 128 against L8's 4) and with a
    second card; past the 128 sequences the logs reach the plan does not extrapolate."""
    old = capacity.parse_version("0.24")
    at = {
        n: capacity.plan(cfg(), serve(RECIPE.replace("64", str(n), 1)), vllm_version=old)
        for n in (64, 128, 512)
    }
    assert terms(at[128])["sequences"] - terms(at[64])["sequences"] == budget.FIT_PER_SEQUENCE * 64
    assert terms(at[512])["sequences"] == terms(at[128])["sequences"]
    two = capacity.plan(cfg(), serve(RECIPE + " -tp 2"), vllm_version=old)
    assert terms(two)["second card"] == budget.FIT_SECOND_CARD
    assert "second card" not in terms(at[64])


def test_the_fitted_constants_are_what_the_fit_gives_on_the_logs() -> None:
    """budget.py's fitted figures and their error are what b70tools.plan_fit prints from the
    B70 logs, so a change to a worked-out term cannot leave them stale."""
    from b70tools import plan_fit

    rows = plan_fit.old_rows()
    base, per_seq, second = plan_fit.fit(rows)
    assert base * GIB == pytest.approx(budget.FIT_BASE, abs=0.001 * GIB)
    assert per_seq * GIB == pytest.approx(budget.FIT_PER_SEQUENCE, abs=0.0005 * GIB)
    assert second * GIB == pytest.approx(budget.FIT_SECOND_CARD, abs=0.001 * GIB)
    low, high = plan_fit.seed_rest()
    assert low * GIB <= budget.FIT_RUNTIME_NEW <= high * GIB


def test_unknown_quantization_is_planned_unsure_and_a_bad_config_is_named() -> None:
    odd = capacity.plan(cfg(), serve("--quantization bitsandbytes"))
    assert any("'bitsandbytes' is not one the plan knows" in n for n in odd.unsure)
    assert not capacity.plan(cfg(), serve("--quantization gptq")).unsure
    broken = dict(cfg())
    del broken["num_hidden_layers"]
    with pytest.raises(ApplianceError, match=r"config\.json: num_hidden_layers is missing"):
        capacity.plan(broken)


def test_the_checkpoints_own_quantization_and_what_it_leaves_out() -> None:
    """A GPTQ checkpoint that keeps attention, GDN and shared experts in bf16 (as
    palmfuture/Qwen3.6-35B-A3B-GPTQ-Int4 says it does) weighs more than one that quantizes
    every linear layer; vLLM reads the method from the config without --quantization."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    every = capacity.plan({**cfg(), "quantization_config": qc})
    kept = capacity.plan({**cfg(), "quantization_config": {
        **qc, "modules_to_not_convert": ["self_attn", "linear_attn", "shared_expert"]}})  # fmt: skip
    flag = capacity.plan(cfg(), serve("--quantization gptq"))
    assert every.weight_bytes == flag.weight_bytes < kept.weight_bytes
    p = model_shape.count_params(model_shape.parse_shape(cfg()))
    int4 = 4 + 20 / 128
    expected = (p.attention + p.linear + p.always) * (2 - int4 / 8)
    assert kept.weight_bytes - every.weight_bytes == pytest.approx(expected, abs=4)
