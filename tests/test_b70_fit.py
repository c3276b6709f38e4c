"""A vLLM recipe that cannot hold one request of its max model length is refused before a
start (switch and a start on demand, in preflight), warned of by install and failed by doctor,
with a fix that fits by the plan; a plan that is unsure lets the start go on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from appliance.config.reader import parse
from appliance.errors import ApplianceError
from appliance.host import gpu
from appliance.measure import capacity, recipe
from appliance.switch import preflight
from b70tools import gpu_trees as t

B70 = Path(__file__).parent / "fixtures" / "b70"
# Qwen3.8-27B GPTQ with MTP4 at 100,000 tokens, one B70, as the cookbook of L16 runs it.
FLAGS = ["--quantization", "gptq", "--dtype", "float16", "--kv-cache-dtype", "fp8",
         "--max-num-seqs", "1", "--max-num-batched-tokens", "8192", "--language-model-only",
         "--speculative-config", '{"method":"mtp","num_speculative_tokens":4}']  # fmt: skip


def runtime(tmp_path: Path, args: list[str], config: str = "Qwen-Qwen3.8-27B") -> object:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    shutil.copy(B70 / f"{config}.json", model / "config.json")
    toml = (
        f'default_runtime = "vllm"\nb70ctl = "/bin/true"\n[runtimes.vllm]\nengine = "vllm"\n'
        f'command = ["/bin/true"]\nmodel = "{model}"\nargs = {json.dumps(args)}\n'
    )
    return parse(toml, tmp_path / "appliance.toml").runtime("vllm")


def b70_snapshot(tmp_path: Path) -> gpu.Snapshot:
    return gpu.snapshot(t.build(tmp_path / "root", [t.Card(t.B70)], []))


def test_a_recipe_that_cannot_fit_is_refused_with_a_fix_that_fits(tmp_path: Path) -> None:
    rt = runtime(
        tmp_path, [*FLAGS, "--max-model-len", "262144", "--gpu-memory-utilization", "0.75"]
    )
    with pytest.raises(ApplianceError) as raised:
        preflight.recipe_fits(rt, b70_snapshot(tmp_path))  # type: ignore[arg-type]
    e = raised.value
    assert e.code == "recipe_does_not_fit"
    assert "runtimes.vllm cannot hold one request of --max-model-len 262144" in e.message
    assert "To serve at least one request with the model's max seq len (262144)" in e.message
    assert e.hint is not None and "`b70ctl plan vllm`" in e.hint
    # Each fix it names fits by the plan.
    cfg = json.loads((B70 / "Qwen-Qwen3.8-27B.json").read_text())
    longest = int(e.hint.split("--max-model-len ")[1].split()[0])
    util = e.hint.split("--gpu-memory-utilization ")[1].split()[0]
    base = [*FLAGS, "--gpu-memory-utilization", "0.75"]
    from appliance.measure import serveflags

    shorter = capacity.plan(cfg, serveflags.parse([*base, "--max-model-len", str(longest)]))
    assert shorter.fits and longest < 262144
    longer = capacity.plan(cfg, serveflags.parse([*base, "--max-model-len", str(longest + 2000)]))
    assert not longer.fits, "the longest that fits, not any that fits"
    more = capacity.plan(cfg, serveflags.parse([*FLAGS, "--max-model-len", "262144",
                                                "--gpu-memory-utilization", util]))  # fmt: skip
    assert more.fits


def test_a_recipe_that_fits_goes_on_and_so_does_one_the_plan_cannot_read(tmp_path: Path) -> None:
    snap = b70_snapshot(tmp_path)
    fits = runtime(tmp_path, [*FLAGS, "--max-model-len", "16384"])
    assert preflight.recipe_fits(fits, snap) == []  # type: ignore[arg-type]
    (tmp_path / "model" / "config.json").write_text("{}")
    notes = preflight.recipe_fits(fits, snap)  # type: ignore[arg-type]
    assert notes and "the plan: config.json: num_hidden_layers is missing" in notes[0]


def test_a_plan_unsure_of_the_quantization_says_so_and_lets_the_start_go_on(tmp_path: Path) -> None:
    args = [a if a != "gptq" else "bitsandbytes" for a in FLAGS]
    rt = runtime(tmp_path, [*args, "--max-model-len", "262144", "--gpu-memory-utilization", "0.5"])
    notes = preflight.recipe_fits(rt, b70_snapshot(tmp_path))  # type: ignore[arg-type]
    assert len(notes) == 1 and "the plan is unsure, so the start goes on" in notes[0]
    assert "'bitsandbytes' is not one the plan knows" in notes[0]


def test_without_a_gpu_the_cpu_build_is_not_planned(tmp_path: Path) -> None:
    rt = runtime(tmp_path, [*FLAGS, "--max-model-len", "262144", "--gpu-memory-utilization", "0.5"])
    empty = gpu.snapshot(t.build(tmp_path / "root", [], []))
    assert preflight.recipe_fits(rt, empty) == []  # type: ignore[arg-type]


def test_install_warns_of_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime(
        tmp_path, [*FLAGS, "--max-model-len", "262144", "--gpu-memory-utilization", "0.75"]
    )
    toml = (
        f'default_runtime = "vllm"\nb70ctl = "/bin/true"\n[runtimes.vllm]\nengine = "vllm"\n'
        f'command = ["/bin/true"]\nmodel = "{rt.model}"\nargs = {json.dumps(list(rt.args))}\n'  # type: ignore[attr-defined]
    )
    config = parse(toml, tmp_path / "appliance.toml")
    monkeypatch.setenv("B70_SYSROOT", str(t.build(tmp_path / "root", [t.Card(t.B70)], [])))
    (warning,) = preflight.recipe_warnings(config)
    assert warning.startswith("warning: runtimes.vllm cannot hold one request")
    assert "--max-model-len" in warning


def test_the_runtime_plan_finds_its_model_in_the_hugging_face_cache(tmp_path: Path) -> None:
    snapshot = tmp_path / "hf" / "hub" / "models--org--qwen" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    shutil.copy(B70 / "Qwen-Qwen3.6-35B-A3B.json", snapshot / "config.json")
    toml = (
        'default_runtime = "vllm"\nb70ctl = "/bin/true"\n[runtimes.vllm]\nengine = "vllm"\n'
        'launcher = "docker"\nimage = "x/vllm:1"\nmodel = "org/qwen"\n'
        f'volumes = ["{tmp_path / "hf"}:/root/.cache/huggingface"]\n'
        'args = ["--max-model-len", "16384", "--quantization", "gptq"]\n'
    )
    rt = parse(toml, tmp_path / "appliance.toml").runtime("vllm")
    assert recipe.find_model_config(rt) == snapshot / "config.json"
    fit = recipe.check(rt)
    assert fit is not None and fit.ok and "one request of 16,384 tokens needs" in fit.detail
    # Unquantized, 35B parameters in bf16 (about 65 GiB) leave a B70 no cache at all.
    whole = parse(toml.replace(', "--quantization", "gptq"', ""), tmp_path / "a.toml")
    fit = recipe.check(whole.runtime("vllm"))
    assert fit is not None and not fit.ok and fit.fix is not None
    assert fit.fix.startswith("the model does not fit this card: more cards")
