"""The plan of every architecture B70 owners run, from published config.json files (each file's
`_provenance` names where it was read and the parameter count its model card states), and of
any config.json at all: a plan, "not planned", or a clear error, never a crash."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from appliance.cli import cli
from appliance.errors import ApplianceError
from appliance.measure import capacity, serveflags

ARCHS = Path(__file__).parent / "fixtures" / "archs"
B70 = Path(__file__).parent / "fixtures" / "b70"
FILES = sorted(ARCHS.glob("*.json"))


def config(name: str) -> dict[str, Any]:
    return json.loads((ARCHS / f"{name}.json").read_text())


def plan(cfg: dict[str, Any], flags: str = "--max-model-len 8192", **kw: Any) -> capacity.Plan:
    return capacity.plan(cfg, serveflags.parse(flags.split()), **kw)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_published_config_is_planned_or_named_never_a_crash(path: Path) -> None:
    out = CliRunner().invoke(cli, ["plan", str(path), "--max-model-len", "8192", "--json"])
    assert "Traceback" not in out.output + out.stderr
    doc = json.loads(out.output)
    if out.exit_code:
        assert doc["error"]["code"] == "plan_input_invalid"
        assert doc["error"]["message"].startswith("config.json: ")
        return
    provenance = json.loads(path.read_text())["_provenance"]
    total = provenance.get("params_total")
    if total and provenance.get("verbatim"):
        assert doc["result"]["params"] == pytest.approx(total, rel=0.05), provenance["source"]


@pytest.mark.parametrize(
    ("name", "experts", "active"),
    [
        ("mistralai--Mixtral-8x7B-Instruct-v0.1", 8, 12.9e9),  # num_local_experts
        ("deepseek-ai--DeepSeek-V2-Lite", 64, 2.4e9),  # n_routed_experts, shared experts
        ("openai--gpt-oss-20b", 32, 3.6e9),  # num_local_experts, experts_per_token
        ("Qwen--Qwen3-30B-A3B", 128, 3.3e9),  # num_experts
        ("MiniMaxAI--MiniMax-M2.7", 256, 10e9),
    ],
)
def test_experts_in_every_spelling_are_experts(name: str, experts: int, active: float) -> None:
    """Mixtral's 46.7B parameters are not planned as a dense 13.5 GiB model: what a token passes
    through is the model card's active count, within 10% (the cards round)."""
    p = plan(config(name))
    assert p.paging is not None
    assert p.active_params_per_token == pytest.approx(active, rel=0.10)
    assert p.params > 3 * p.active_params_per_token, f"{experts} experts"


def test_deepseek_keeps_its_first_layers_dense_and_its_latent_is_one_per_token() -> None:
    p = plan(config("deepseek-ai--DeepSeek-V2-Lite"))
    # kv_lora_rank 512 + qk_rope_head_dim 64, in bf16, in each of 27 layers
    assert p.kv_bytes_per_token == (512 + 64) * 2 * 27
    assert any("latent attention" in n for n in p.unsure)
    two = plan(config("deepseek-ai--DeepSeek-V2-Lite"), "--max-model-len 8192 -tp 2")
    assert two.paging.attention_bytes_per_token == p.paging.attention_bytes_per_token


def test_windowed_layers_hold_only_their_window() -> None:
    """gpt-oss-20b: 12 of its 24 layers attend to the last 128 tokens. A request of 131,072
    tokens takes 2,048 blocks of 64 in the full layers' group and, in the windowed group, those
    of its window and one step's 2,048 tokens and one more: 35."""
    p = plan(config("openai--gpt-oss-20b"), "--max-model-len 131072")
    g = p.paging
    assert (g.attention_groups, g.window_groups, g.group_size) == (1, 1, 12)
    assert g.blocks_per_max_len == 2048 + 35
    all_full = config("openai--gpt-oss-20b")
    all_full["layer_types"] = ["full_attention"] * 24
    full = plan(all_full, "--max-model-len 131072").paging
    assert full.needed_bytes == 2048 * 24 * g.page_bytes > 1.9 * g.needed_bytes


def test_mxfp4_experts_and_the_layers_left_out() -> None:
    """gpt-oss's experts in MXFP4 (4 bits and an 8-bit scale per 32: 4.25 bits), its attention,
    router, embedding and head in bf16 (`modules_to_not_convert`)."""
    p = plan(config("openai--gpt-oss-20b"))
    assert 12.5 < p.weight_bytes / 1024**3 < 13.1


def test_a_long_dense_context_that_vllm_fits_is_not_refused() -> None:
    """Llama-3.1-8B in bf16 at 100,000 tokens on one B70: inside the plan's range, so a start
    goes on with a warning, and `fits_at_most` says so."""
    p = plan(config("meta-llama--Llama-3.1-8B-Instruct"), "--max-model-len 100000")
    assert p.fits_at_most and not p.fits_at_least


MUTATIONS: list[Any] = [None, 0, -1, 1.5, "12", [], {}, [1, 2], True, 10**30, 2**40 + 1, "x"]
FIELDS = [
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "experts_per_token",
    "layer_types",
    "sliding_window",
    "sliding_window_pattern",
    "full_attention_interval",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "quantization_config",
    "text_config",
    "vision_config",
    "max_position_embeddings",
    "mamba_ssm_dtype",
    "tie_word_embeddings",
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "first_k_dense_replace",
    "moe_layer_freq",
    "mlp_only_layers",
    "attn_type_list",
    "torch_dtype",
    "mtp_num_hidden_layers",
]
BASES = [
    B70 / "Qwen-Qwen3.6-35B-A3B.json",
    ARCHS / "openai--gpt-oss-20b.json",
    ARCHS / "deepseek-ai--DeepSeek-V2-Lite.json",
]


@pytest.mark.parametrize("base", BASES, ids=[b.stem for b in BASES])
def test_no_config_json_makes_a_traceback(base: Path) -> None:
    """Each field missing, zero, negative, a string, a list, an object, huge, and odd layer
    types: a plan or an ApplianceError, for the plan and for the switch's check alike."""
    original = json.loads(base.read_text())
    flags = serveflags.parse(
        [
            "--max-model-len",
            "4096",
            "--speculative-config",
            '{"method": "mtp", "num_speculative_tokens": 2}',
        ]
    )
    tried = 0
    for field in FIELDS:
        for value in [*MUTATIONS, "missing"]:
            cfg = copy.deepcopy(original)
            target = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
            if value == "missing":
                target.pop(field, None)
            else:
                target[field] = value
            if field == "layer_types" and value == "x":
                target[field] = ["banana_attention"] * 40
            tried += 1
            try:
                capacity.plan(cfg, flags)
            except ApplianceError as e:
                assert e.message, (field, value)
    assert tried == len(FIELDS) * (len(MUTATIONS) + 1)


def test_a_broken_config_on_the_command_line_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    cfg = config("openai--gpt-oss-20b")
    cfg["num_hidden_layers"] = "twenty-four"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = CliRunner().invoke(cli, ["plan", str(path)])
    assert out.exit_code == 1 and "Traceback" not in out.output + out.stderr
    assert "num_hidden_layers is 'twenty-four', not a whole number" in out.stderr
