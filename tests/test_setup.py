"""`b70ctl setup`, run as a person runs it, on fixture trees of one B70, of two, of none, and of
cards too small: the config it writes holds examples/b70.toml's recipes, loads, and is never
written over without --force."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from b70tools import gpu_trees

REPO = Path(__file__).resolve().parent.parent
B70CTL = str(Path(sys.executable).parent / "b70ctl")


def b70ctl(
    root: Path, config: Path, *args: str, path: str = "/nonexistent"
) -> subprocess.CompletedProcess[str]:
    """`b70ctl setup`; `path`: the PATH it looks for docker and podman on (by default, neither)."""
    env = {k: v for k, v in os.environ.items() if k not in ("B70_CONFIG", "B70_SYSROOT")}
    env["PATH"] = path
    out = subprocess.run([B70CTL, "--user", "--config", str(config), "setup", "--root", str(root),
                          *args], env=env, capture_output=True, text=True, timeout=60,
                         check=False)  # fmt: skip
    assert "Traceback" not in out.stderr, out.stderr
    return out


def _runtimes(text: str) -> dict[str, Any]:
    return tomllib.loads(text)["runtimes"]


def test_one_b70_gets_examples_b70_toml_recipes(tmp_path: Path) -> None:
    root = gpu_trees.healthy_host(tmp_path / "root", [gpu_trees.B70])
    config = tmp_path / "etc" / "appliance.toml"
    shown = b70ctl(root, config, "--dry-run")
    assert shown.returncode == 0, shown.stderr
    assert not config.exists()  # a dry run writes nothing
    example = tomllib.loads((REPO / "examples" / "b70.toml").read_text())
    runtimes = _runtimes(shown.stdout)
    # The recipes are the example's; only where they run from differs: the published images and
    # the models by name, where the example has a hand-built llama-server and files in place.
    where = {"launcher", "image", "command", "user", "devices", "volumes", "model", "mmproj"}
    for name, table in example["runtimes"].items():
        assert {k: v for k, v in runtimes[name].items() if k not in where} == {
            k: v for k, v in table.items() if k not in where
        }, name
        for key in ("model", "mmproj"):
            if key in table:
                assert runtimes[name][key].startswith("hf:")
                assert (
                    runtimes[name][key].rsplit("/", 1)[-1].split("-")[:3]
                    == (table[key].rsplit("/", 1)[-1].split("-")[:3])
                ), key
    assert runtimes["llamacpp"]["launcher"] == runtimes["vllm"]["launcher"] == "docker"
    assert runtimes["llamacpp"]["image"].startswith("ghcr.io/ggml-org/llama.cpp:server-intel-b")
    written = tomllib.loads(shown.stdout)
    for key in ("proxy", "backend", "default_runtime"):
        assert written[key] == example[key], key
    assert "# 0000:03:00.0 (Intel Arc Pro B70, 32.0 GiB)." in shown.stdout
    assert "# vLLM on card 0: it needs 26.3 GiB" in shown.stdout  # a comment per choice
    assert "# llama.cpp (SYCL) on card 0" in shown.stdout
    done = b70ctl(root, config)
    assert done.returncode == 0, done.stderr
    assert config.read_text() == shown.stdout
    assert f"wrote {config}" in done.stdout and "next: sudo b70ctl install" in done.stdout


def test_a_config_there_is_replaced_only_with_force_and_then_kept(tmp_path: Path) -> None:
    root = gpu_trees.healthy_host(tmp_path / "root", [gpu_trees.B70])
    config = tmp_path / "appliance.toml"
    config.write_text("# mine\n")
    refused = b70ctl(root, config)
    assert refused.returncode == 1
    assert f"error: {config} exists: setup does not replace a config" in refused.stderr
    assert "--force replaces it" in refused.stderr
    assert config.read_text() == "# mine\n"
    forced = json.loads(b70ctl(root, config, "--force", "--json").stdout)["result"]
    kept = Path(forced["kept"])
    assert kept.parent == tmp_path and kept.name.startswith("appliance.toml.")
    assert kept.name.endswith(".bak") and kept.read_text() == "# mine\n"
    assert config.read_text() == forced["text"] and forced["written"]


def test_two_b70s_get_tensor_parallel_vllm_and_a_llamacpp_per_card(tmp_path: Path) -> None:
    root = gpu_trees.healthy_host(tmp_path / "root", [gpu_trees.B70, gpu_trees.B70_2])
    out = b70ctl(root, tmp_path / "a.toml", "--dry-run")
    assert out.returncode == 0, out.stderr
    runtimes = _runtimes(out.stdout)
    four = tomllib.loads((REPO / "examples" / "b70-4cards.toml").read_text())["runtimes"]
    assert runtimes["vllm"]["cards"] == [0, 1]
    assert runtimes["vllm"]["args"] == four["vllm-tp4"]["args"]
    assert runtimes["llamacpp"]["per_card"] and runtimes["llamacpp"]["cards"] == [0, 1]
    assert tomllib.loads(out.stdout)["gpu"]["cards"] == [gpu_trees.B70, gpu_trees.B70_2]
    from appliance.config import parse

    config = parse(out.stdout, tmp_path / "a.toml")
    assert sorted(config.runtimes) == ["llamacpp-0", "llamacpp-1", "vllm"]
    assert config.runtime("vllm").card_indices == (0, 1)


def test_no_cards_and_cards_too_small_are_named_and_nothing_is_written(tmp_path: Path) -> None:
    config = tmp_path / "appliance.toml"
    none = b70ctl(gpu_trees.healthy_host(tmp_path / "none", []), config)
    assert none.returncode == 1 and "no Intel GPU here to serve" in none.stderr, none.stderr
    assert "b70ctl doctor" in none.stderr
    small = tmp_path / "small"
    gpu_trees.build(small, [gpu_trees.Card(gpu_trees.B70, device=0xE20B, vram_total=12 * 1024**3)],
                    [])  # fmt: skip
    too_small = b70ctl(small, config)
    assert too_small.returncode == 1, too_small.stderr
    assert "no recipe fits these cards: the smallest needs 22 GiB" in too_small.stderr
    assert "has 12.0 GiB" in too_small.stderr
    assert not config.exists()
    mid = tmp_path / "mid"
    gpu_trees.build(mid, [gpu_trees.Card(gpu_trees.B70, device=0xE20B, vram_total=24 * 1024**3)],
                    [])  # fmt: skip
    only_llama = b70ctl(mid, config, "--dry-run")
    assert only_llama.returncode == 0, only_llama.stderr
    assert list(_runtimes(only_llama.stdout)) == ["llamacpp"]
    assert tomllib.loads(only_llama.stdout)["default_runtime"] == "llamacpp"


def test_the_images_run_under_the_engine_installed(tmp_path: Path) -> None:
    root = gpu_trees.healthy_host(tmp_path / "root", [gpu_trees.B70])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    podman = bin_dir / "podman"
    podman.write_text("#!/bin/sh\n")
    podman.chmod(0o755)
    out = b70ctl(root, tmp_path / "a.toml", "--dry-run", path=str(bin_dir))
    assert out.returncode == 0, out.stderr
    written = tomllib.loads(out.stdout)
    assert {rt["launcher"] for rt in written["runtimes"].values()} == {"podman"}
    assert written["podman"] == str(podman)  # not where the config looks by default
    assert "# The images run under podman: it is installed here and docker is not." in out.stdout
    docker = bin_dir / "docker"
    docker.write_text("#!/bin/sh\n")
    docker.chmod(0o755)
    both = tomllib.loads(b70ctl(root, tmp_path / "a.toml", "--dry-run", path=str(bin_dir)).stdout)
    assert {rt["launcher"] for rt in both["runtimes"].values()} == {"docker"}
    assert both["docker"] == str(docker) and "podman" not in both


def test_an_old_kernel_gets_no_tensor_parallelism_and_says_why(tmp_path: Path) -> None:
    """Owners report multi-card collectives broken on kernels before 7.1: there, two B70s get
    vLLM on one card (and a llama.cpp per card), so that doctor's kernel check passes."""
    root = gpu_trees.healthy_host(tmp_path / "root", [gpu_trees.B70, gpu_trees.B70_2])
    (root / "proc/sys/kernel/osrelease").write_text("6.8.0-45-generic\n")
    out = b70ctl(root, tmp_path / "a.toml", "--dry-run")
    assert out.returncode == 0, out.stderr
    runtimes = _runtimes(out.stdout)
    assert runtimes["vllm"]["cards"] == [0]
    assert runtimes["llamacpp"]["per_card"] and runtimes["llamacpp"]["cards"] == [0, 1]
    assert "# No tensor parallelism: this kernel (6.8.0-45-generic) is older than 7.1" in out.stdout
    said = " ".join(line.lstrip("# ") for line in out.stdout.splitlines() if line.startswith("#"))
    assert "After booting 7.1 or later, `b70ctl setup --force` offers vLLM over 2 cards" in said
