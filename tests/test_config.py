"""Configuration: the examples load, and every malformed config is refused by name, with nothing
written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance import config
from appliance.cli import cli
from appliance.config import Engine, Launcher
from appliance.errors import ConfigError
from tests.configs import BAD, GOOD
from tests.conftest import REPO, tree_snapshot


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


def test_a_config_that_is_not_utf8_names_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "appliance.toml"
    path.write_bytes(GOOD.encode() + b"\n# caf\xe9\n")
    offset = len(GOOD.encode()) + len(b"\n# caf")
    with pytest.raises(ConfigError) as e:
        config.load(path)
    assert (
        e.value.message
        == f"{path}: not UTF-8: byte {offset} (line {GOOD.count(chr(10)) + 2}) is 0xe9"
    )
    result = CliRunner().invoke(cli, ["--config", str(path), "render"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"not UTF-8: byte {offset}" in result.stderr


def test_hosts_that_do_not_clash() -> None:
    assert not config.hosts_overlap("127.0.0.1", "192.168.1.5")
    assert not config.hosts_overlap("10.0.0.1", "10.0.0.2")
    assert config.hosts_overlap("::", "127.0.0.1")
    assert config.hosts_overlap("localhost", "::1")
    assert config.hosts_overlap("0.0.0.0", "box.lan")


def test_numbers_in_range_and_names_that_pass() -> None:
    text = GOOD.replace("[runtimes.vllm]", "[runtimes.vllm-tp4]").replace(
        'model = "/models/hf"',
        'model = "/models/hf"\nstart_timeout_s = 86400\nmemory_needed_gib = 0\n'
        'args = ["--chat-template", "{% if x %}$HOME \\\\ \\"q\\" ; caf\u00e9"]',
    )
    cfg = config.parse(text.replace("port = 8000", "port = 8000\nmax_body_mib = 0.5"), Path("t"))
    assert cfg.proxy.max_body_bytes == 512 * 1024
    rt = cfg.runtimes["vllm-tp4"]
    assert rt.start_timeout_s == 86400 and rt.memory_needed_bytes == 0
    assert rt.args[1] == '{% if x %}$HOME \\ "q" ; caf\u00e9'


def test_fair_turns_know_each_runtimes_slots_unless_the_config_turns_them_off() -> None:
    """vLLM's --max-num-seqs (its default without it), llama.cpp's --parallel (its /props says
    it without): B70_SLOTS; off, B70_FAIR=0 and no slots."""
    from appliance.layout import Scope, layout
    from appliance.units.render import proxy_environment
    from appliance.units.runtimes import VLLM_MAX_NUM_SEQS

    on = config.parse(GOOD, Path("t"))
    env = proxy_environment(on, layout(Scope.USER))
    assert "B70_FAIR" not in env and env["B70_BATCH_WAIT_S"] == "30"
    assert "B70_BATCH_SHARE" not in env  # every place but one, the default
    shared = config.parse(GOOD.replace('model = "smollm2"', 'model = "smollm2"\nbatch_share = 0.4'),
                          Path("t"))  # fmt: skip
    assert proxy_environment(shared, layout(Scope.USER))["B70_BATCH_SHARE"] == "0.4"
    words = dict(w.split("=") for w in env["B70_SLOTS"].split())
    ports = {rt.engine.value: rt.port for rt in on.runtimes.values()}
    assert words[f"{ports['vllm']}/vLLM"] == str(VLLM_MAX_NUM_SEQS)
    seqs = GOOD.replace(
        'model = "/models/hf"', 'model = "/models/hf"\nargs = ["--max-num-seqs=12"]'
    )
    env = proxy_environment(config.parse(seqs, Path("t")), layout(Scope.USER))
    assert f"{ports['vllm']}/vLLM=12" in env["B70_SLOTS"].split(), env["B70_SLOTS"]
    off = config.parse(GOOD.replace('model = "smollm2"', 'model = "smollm2"\nfair = false'),
                       Path("t"))  # fmt: skip
    env = proxy_environment(off, layout(Scope.USER))
    assert env["B70_FAIR"] == "0" and "B70_SLOTS" not in env


def test_the_pass_through_is_on_unless_the_config_turns_it_off() -> None:
    """Off, the proxy unit says so (B70_PASS_THROUGH=0); on, the rendered units are as before."""
    from appliance.layout import Scope, layout
    from appliance.units.render import proxy_environment

    on = config.parse(GOOD, Path("t"))
    off = config.parse(GOOD.replace('model = "smollm2"', 'model = "smollm2"\npass_through = false'),
                       Path("t"))  # fmt: skip
    assert on.proxy.pass_through and not off.proxy.pass_through
    assert "B70_PASS_THROUGH" not in proxy_environment(on, layout(Scope.USER))
    assert proxy_environment(off, layout(Scope.USER))["B70_PASS_THROUGH"] == "0"
