"""Configuration: the examples load, and every malformed config is refused by name, with nothing
written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance import config
from appliance.cli import cli
from appliance.config import Engine, Launcher
from tests.conftest import REPO, tree_snapshot

GOOD = """
default_runtime = "llamacpp"

[proxy]
port = 8000
model = "smollm2"

[runtimes.llamacpp]
engine = "llamacpp"
command = ["/usr/bin/true"]
model = "/models/m.gguf"

[runtimes.vllm]
engine = "vllm"
model = "/models/hf"
"""

# (name, config text, text the error must contain: the dotted key and what is wrong)
BAD = [
    (
        "vllm shutdown timeout in args",
        GOOD.replace(
            'model = "/models/hf"', 'model = "/models/hf"\nargs = ["--shutdown-timeout=5"]'
        ),
        "runtimes.vllm.args: sets --shutdown-timeout, which the appliance sets itself",
    ),
    (
        "negative drain",
        GOOD.replace('model = "smollm2"', 'model = "smollm2"\ndrain_s = -1'),
        "proxy.drain_s: -1.0 must not be negative",
    ),
    ("toml syntax", "default_runtime = ", "not valid TOML"),
    ("unknown top key", GOOD + "\nmodel_dir = '/x'\n", "model_dir: unknown key"),
    (
        "typo in runtime key",
        GOOD.replace('model = "/models/hf"', 'modle = "/models/hf"'),
        "runtimes.vllm.modle: unknown key",
    ),
    ("missing model", GOOD.replace('model = "/models/hf"', ""), "runtimes.vllm.model: missing"),
    (
        "port not a number",
        GOOD.replace("port = 8000", 'port = "8000"'),
        "proxy.port: must be an integer, not a string",
    ),
    (
        "port out of range",
        GOOD.replace("port = 8000", "port = 70000"),
        "proxy.port: 70000 is not a TCP port",
    ),
    (
        "same port twice",
        GOOD + "\n[backend]\nport = 8000\n",
        "backend.port: 8000 is also proxy.port",
    ),
    (
        "bad engine",
        GOOD.replace('engine = "vllm"', 'engine = "tgi"'),
        "runtimes.vllm.engine: 'tgi' is not one of",
    ),
    (
        "bad launcher",
        GOOD.replace('engine = "vllm"', 'engine = "vllm"\nlauncher = "lxc"'),
        "runtimes.vllm.launcher: 'lxc' is not one of",
    ),
    (
        "docker without image",
        GOOD.replace('engine = "vllm"', 'engine = "vllm"\nlauncher = "docker"'),
        "runtimes.vllm.image: missing",
    ),
    (
        "default not configured",
        GOOD.replace('default_runtime = "llamacpp"', 'default_runtime = "tgi"'),
        "default_runtime: 'tgi' is not a configured runtime",
    ),
    ("no runtimes", "[proxy]\nport = 8000\n", "runtimes: no runtime is configured"),
    (
        "bad runtime name",
        GOOD.replace("[runtimes.vllm]", "[runtimes.VLLM_big]"),
        "runtimes.VLLM_big: a runtime name",
    ),
    (
        "args set the port",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nargs = ["--port", "9"]'),
        "runtimes.vllm.args: sets --port",
    ),
    (
        "env not a string",
        GOOD + "\n[runtimes.vllm.env]\nVLLM_CPU_KVCACHE_SPACE = 1\n",
        "runtimes.vllm.env.VLLM_CPU_KVCACHE_SPACE: must be a string",
    ),
    (
        "negative timeout",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nstart_timeout_s = -5'),
        "runtimes.vllm.start_timeout_s: -5.0 must be greater than 0",
    ),
    (
        "mmproj on vllm",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nmmproj = "/m.gguf"'),
        "runtimes.vllm.mmproj: only the llamacpp engine",
    ),
    (
        "args not a list",
        GOOD.replace('model = "/models/hf"', 'model = "/models/hf"\nargs = "--enforce-eager"'),
        "runtimes.vllm.args: must be a list of strings",
    ),
    (
        "proxy not a table",
        GOOD.replace('[proxy]\nport = 8000\nmodel = "smollm2"', "proxy = 8000"),
        "proxy: must be a table",
    ),
    (
        "bad model name",
        GOOD.replace('model = "smollm2"', 'model = "small model"'),
        "proxy.model: 'small model'",
    ),
    (
        "bad gpu device",
        GOOD + '\n[gpu]\ndevice = "card0"\n',
        "gpu.device: 'card0' is neither 'auto'",
    ),
    (
        "relative b70ctl",
        'b70ctl = "bin/b70ctl"\n' + GOOD,
        "b70ctl: 'bin/b70ctl' must be an absolute path",
    ),
    (
        "command on docker",
        GOOD.replace(
            'engine = "vllm"', 'engine = "vllm"\nlauncher = "docker"\nimage = "x"\ncommand = ["/x"]'
        ),
        "runtimes.vllm.command: container launchers",
    ),
]


def test_the_examples_load() -> None:
    b70 = config.load(REPO / "examples" / "b70.toml")
    assert set(b70.runtimes) == {"vllm", "llamacpp"}
    vllm = b70.runtimes["vllm"]
    assert (vllm.engine, vllm.launcher) == (Engine.VLLM, Launcher.DOCKER)
    assert vllm.image == "ghcr.io/riceharvest/b70-vllm:v0.31.0-b70.3"
    assert vllm.model == "palmfuture/Qwen3.6-35B-A3B-GPTQ-Int4"
    assert vllm.env == {
        "B70_TARGET_LMHEAD_FP8": "1",
        "B70_LINEAR_FP8_FREE": "1",
        "B70_LINEAR_FP8_RE": r"(self_attn\.(qkv_proj|o_proj)|linear_attn\.(in_proj_qkvz|in_proj_qkv"
        r"|in_proj_z|out_proj)|shared_expert\.(gate_up_proj|down_proj))$",
    }
    assert " ".join(vllm.args) == (
        "--quantization gptq --dtype float16 --kv-cache-dtype fp8 --max-model-len 16384 "
        "--gpu-memory-utilization 0.82 --max-num-seqs 64 --max-num-batched-tokens 8192 "
        "--language-model-only --cpu-offload-gb 4 --cpu-offload-params embed_tokens "
        "--no-enable-prefix-caching --mamba-ssm-cache-dtype float16 --compilation-config "
        '{"cudagraph_capture_sizes":[1,2,4,8,16,24,32,40,48,56,64]}'
    )
    assert vllm.shm_size == "8g" and vllm.devices == ("/dev/dri",)
    llama = b70.runtimes["llamacpp"]
    assert llama.model.endswith("Q4_K_M.gguf") and llama.mmproj
    assert " ".join(llama.args) == "-ngl 99 -fa on -ctk q8_0 -ctv q8_0 -c 131072 --parallel 1"
    demo = config.load(REPO / "examples" / "demo.toml")
    assert {rt.engine for rt in demo.runtimes.values()} == {Engine.VLLM, Engine.LLAMACPP}
    assert demo.proxy.model == "smollm2"


def test_there_are_at_least_15_distinct_bad_configs() -> None:
    assert len({case[1] for case in BAD}) >= 15


@pytest.mark.parametrize(("name", "text", "expected"), BAD, ids=[c[0] for c in BAD])
def test_bad_config_is_refused_by_name_and_nothing_is_written(
    name: str, text: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text(text)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    before = tree_snapshot(tmp_path)
    for args in (["install"], ["render", "--out", str(tmp_path / "out")], ["switch", "vllm"]):
        result = CliRunner().invoke(cli, ["--user", "--config", str(path), *args])
        assert result.exit_code == 2, (args, result.output)
        assert f"error: {path}: " in result.stderr
        assert expected in result.stderr
        assert result.stdout == ""
        assert tree_snapshot(tmp_path) == before


def test_missing_config_file_says_what_to_do(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--config", str(tmp_path / "nope.toml"), "status"])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {tmp_path / 'nope.toml'}: no such configuration file\n"
        "hint: copy examples/demo.toml or examples/b70.toml there, or pass --config\n"
    )


def test_install_writes_nothing_when_systemd_analyze_verify_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = GOOD.replace('command = ["/usr/bin/true"]', 'command = ["/nonexistent/llama-server"]')
    path = tmp_path / "appliance.toml"
    path.write_text(text)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    before = tree_snapshot(tmp_path)
    result = CliRunner().invoke(cli, ["--user", "--config", str(path), "install"])
    assert result.exit_code == 1
    assert "do not pass `systemd-analyze verify`; nothing was installed" in result.stderr
    assert "Command /nonexistent/llama-server is not executable" in result.stderr
    assert tree_snapshot(tmp_path) == before
