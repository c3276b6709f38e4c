"""Starts that remember, on real parts: the demo's vLLM (CPU build, torch.compile on) under a real
systemd user manager, its lasting cache warmed by `install --warm`, then found again by a start
through `b70ctl switch`; and a llama-server whose cache folder cannot be written, which starts
cold through the unit's environment file instead of failing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from appliance.engines import lasting
from b70tools.demo_appliance import demo_text, recipe_folder
from tests.conftest import (
    CACHE,
    Appliance,
    Manager,
    installed,
    require_real_parts,
    running_manager,
)
from tests.conftest import free_port as port


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {
        lasting.STAMP,
        lasting.STARTED,
    }


@contextmanager
def demo(tmp_path: Path, compiled: bool, *install: str) -> Iterator[tuple[Manager, Appliance]]:
    """The demo appliance on a user manager of its own (its own %C), installed with `install`'s
    arguments; purged and stopped after."""
    require_real_parts()
    proxy_port, backend_port = port(), port()
    config = tmp_path / "appliance.toml"
    text = demo_text(proxy_port, backend_port, str(CACHE), threads=1, compiled=compiled)
    config.write_text(text)
    with (
        running_manager(tmp_path / "m") as manager,
        installed(manager, config, proxy_port, backend_port, args=install) as app,
    ):
        yield manager, app


def test_a_second_vllm_start_finds_what_the_first_compiled(tmp_path: Path) -> None:
    """install --warm compiles vLLM once; the next start through a switch is warm: vLLM compiles
    no kernel its first start had not left in the folder, and says of no load failure."""
    with demo(tmp_path, True, "--warm") as (manager, app):
        folder = recipe_folder(manager.env, "vllm")
        # install warmed vLLM, then handed back to the default runtime
        assert app.json("status")["result"]["active_runtime"] == "llamacpp"
        assert (folder / lasting.STARTED).is_file()
        first = files(folder)
        assert any(name.startswith("inductor/") for name in first), sorted(first)
        # doctor says so (it fails here for the card it cannot find, and prints every check)
        assert "ok   vllm: cache: warm for the installed recipe" in app.b70ctl("doctor").stdout
        # the warm-up's switch said it started cold, with nothing kept yet
        history = (Path(manager.env["XDG_STATE_HOME"]) / "b70" / "switches.jsonl").read_text()
        warm_up = [json.loads(line) for line in history.splitlines()][-2]
        assert warm_up["to"] == "vllm" and warm_up["start"]["verdict"] == "cold", warm_up

        out = app.json("switch", "vllm")
        assert out["ok"], out
        start = out["result"]["start"]
        assert start["verdict"] == "warm", out["result"]
        assert any("vllm started warm" in n for n in out["result"]["notes"]), out["result"]
        journal = app.b70ctl("logs", "vllm", "-n", "400").stdout
        assert "load failure" not in journal
        assert "init engine (profile, create kv cache, warmup model) took" in journal
        assert files(folder) == first  # nothing compiled that the first start had not
        print(
            f"init engine: warm-up {warm_up['start'].get('init_s')} s, second {start['init_s']} s"
        )


def test_a_cache_folder_that_cannot_be_written_starts_cold_not_failed(tmp_path: Path) -> None:
    with demo(tmp_path, False) as (manager, app):
        folder = recipe_folder(manager.env, "llamacpp")
        assert (folder / "neo").is_dir() and (folder / "sycl").is_dir()
        # the recipe's folder becomes a file: nothing can be made or written in it
        for path in sorted(folder.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        folder.rmdir()
        folder.write_text("not a folder")
        out = app.json("switch", "llamacpp", "--restart")
        assert out["ok"], out
        start = out["result"]["start"]
        assert start["verdict"] == "cold"
        assert start["cause"] == "the cache cannot be written (Not a directory)", start
        pid = manager.systemctl("show", "-p", "MainPID", "--value", "b70-llamacpp.service")
        environ = Path(f"/proc/{pid.strip()}/environ").read_bytes().split(b"\0")
        assert f"NEO_CACHE_DIR={lasting.COLD_ROOT}/neo".encode() in environ
        assert app.ask()  # it serves
        logs = app.b70ctl("logs", "llamacpp", "-n", "200").stdout
        said = [line for line in logs.splitlines() if "keeps nothing" in line]
        assert len(said) == 1 and "b70 cache: cold: " in said[0], said


def test_install_removes_the_cache_of_a_recipe_no_longer_installed(tmp_path: Path) -> None:
    with demo(tmp_path, False) as (manager, app):
        cache_home = Path(manager.env["XDG_CACHE_HOME"])
        old = recipe_folder(manager.env, "llamacpp")
        assert old.is_dir()
        app.b70ctl("switch", "vllm", check=True)  # llama.cpp does not run: its folder may go
        text = app.config.read_text()
        app.config.write_text(text.replace('"-c", "2048"', '"-c", "1024"'))
        out = app.json("install")
        assert out["ok"], out
        new = recipe_folder(manager.env, "llamacpp")
        assert new != old and not old.exists()
        assert any(str(old) in note for note in out["result"]["notes"]), out["result"]
    assert not (cache_home / "b70-llamacpp").exists()  # uninstall --purge
