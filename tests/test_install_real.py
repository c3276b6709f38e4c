"""`b70ctl install` and `render --diff` against a real systemd user manager."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    GGUF,
    LLAMA_SERVER,
    Appliance,
    demo_config_text,
    free_port,
    require_real_parts,
    running_manager,
    tree_snapshot,
)


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Appliance]:
    require_real_parts()
    with running_manager(tmp_path / "manager") as manager:
        cfg = tmp_path / "appliance.toml"
        proxy_port, backend_port = free_port(), free_port()
        cfg.write_text(demo_config_text(proxy_port, backend_port))
        app = Appliance(manager, cfg, proxy_port, backend_port)
        try:
            yield app
        finally:
            app.b70ctl("uninstall", "--purge")


def test_a_busy_proxy_port_is_named_and_nothing_is_written(fresh: Appliance) -> None:
    homes = Path(fresh.manager.env["XDG_CONFIG_HOME"]).parent
    before = tree_snapshot(homes / "config")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", fresh.proxy_port))
        squatter.listen()
        out = fresh.b70ctl("install")
    assert out.returncode == 1
    assert f"error: the proxy port {fresh.proxy_port} is held by pid " in out.stderr
    assert "which is not part of the appliance" in out.stderr
    assert tree_snapshot(homes / "config") == before
    # Once the port is free the same command succeeds.
    fresh.b70ctl("install", check=True)
    assert fresh.json("status")["result"]["active_runtime"] == "llamacpp"


def test_render_diff_and_a_second_install(fresh: Appliance) -> None:
    fresh.b70ctl("install", check=True)
    clean = fresh.b70ctl("render", "--diff")
    assert clean.returncode == 0 and clean.stdout == ""
    again = fresh.json("install")["result"]
    assert again["written"] == [] and again["started"] == [] and not again["key_created"]

    text = fresh.config.read_text().replace('"--threads", "1"]', '"--threads", "2"]')
    fresh.config.write_text(text)
    diff = fresh.b70ctl("render", "--diff")
    assert diff.returncode == 1
    assert "-ExecStart=" in diff.stdout and "--threads 2" in diff.stdout
    # A switch refuses a unit that no longer matches the config, and says what to do.
    stale = fresh.b70ctl("switch", "llamacpp", "--restart")
    assert stale.returncode == 1
    assert "b70-llamacpp.service differs from what" in stale.stderr
    assert "hint: run `b70ctl render --diff` to see how, then `b70ctl install`" in stale.stderr
    installed = Path(fresh.manager.env["XDG_CONFIG_HOME"]) / "b70" / "appliance.toml"
    previous = installed.read_text()
    third = fresh.json("install")["result"]
    assert [Path(p).name for p in third["written"]] == ["b70-llamacpp.service"]
    # The installed config is replaced only with a word, and kept as a dated backup.
    change = third["config"]
    assert change["path"] == str(installed) and installed.read_text() == text
    backup = Path(change["backup"])
    assert backup.parent == installed.parent and backup.name.startswith("appliance.toml.")
    assert backup.name.endswith(".bak") and backup.read_text() == previous
    assert (
        '-args = ["--embeddings", "--pooling", "mean", "-c", "2048", "--parallel", "2", '
        '"--threads", "1"]' in change["diff"]
    )
    assert (
        '+args = ["--embeddings", "--pooling", "mean", "-c", "2048", "--parallel", "2", '
        '"--threads", "2"]' in change["diff"]
    )
    assert third["notes"] == [
        "b70-llamacpp.service changed while it runs; `b70ctl switch llamacpp --restart` applies it"
    ]
    restarted = fresh.json("switch", "llamacpp", "--restart")["result"]
    assert restarted["ok"] and restarted["previous"] == "llamacpp"
    assert fresh.b70ctl("render", "--diff").stdout == ""


def test_two_managers_on_one_machine_do_not_touch_each_other(
    appliance: Appliance, fresh: Appliance
) -> None:
    """Each private manager has a cgroup of its own: stopping a unit in one kills nothing in the other."""
    appliance.b70ctl("switch", "llamacpp", check=True)

    def main_pid() -> str:
        return appliance.manager.systemctl(
            "show", "-p", "MainPID", "--value", "b70-llamacpp.service"
        ).strip()

    before = main_pid()
    fresh.b70ctl("install", check=True)
    fresh.b70ctl("uninstall", check=True)
    assert main_pid() == before != "0"
    assert appliance.ask().strip()


def test_a_runtime_taken_out_of_the_config_is_removed_and_a_foreign_unit_is_kept(
    fresh: Appliance,
) -> None:
    units = Path(fresh.manager.env["XDG_CONFIG_HOME"]) / "systemd" / "user"
    text = fresh.config.read_text()
    spare = f'\n[runtimes.spare]\nengine = "llamacpp"\ncommand = ["{LLAMA_SERVER}"]\n'
    fresh.config.write_text(text + spare + f'model = "{GGUF}"\n')
    fresh.b70ctl("install", check=True)
    assert (units / "b70-spare.service").exists()
    mine = units / "b70-mine.service"  # the user's own, with a b70- name
    mine.write_text("[Service]\nExecStart=/bin/true\n")
    fresh.config.write_text(text)
    out = fresh.json("install")["result"]
    assert out["removed"] == [str(units / "b70-spare.service")]
    assert not (units / "b70-spare.service").exists() and mine.exists()
    load = fresh.manager.systemctl("show", "-p", "LoadState", "--value", "b70-spare.service")
    assert load.strip() == "not-found"
    assert fresh.json("status")["result"]["active_runtime"] == "llamacpp"
    assert fresh.json("install")["result"]["removed"] == []


def test_a_runtime_whose_hub_model_is_not_pulled_is_not_started_and_says_what_to_pull(
    fresh: Appliance, tmp_path: Path
) -> None:
    """An install that pulls nothing (`--no-pull`; install pulls first by default: tests/test_hub.py),
    and a switch, with `model = "hf:..."` not pulled yet: the runtime is not started to fail for
    want of it, and both say which command fetches it."""
    text = fresh.config.read_text()
    gguf = next(
        line for line in text.splitlines() if line.startswith("model = ") and "gguf" in line
    )
    text = text.replace(gguf, 'model = "hf:acme/tiny-GGUF:Q4_K_M"')
    fresh.config.write_text(text + f'\n[models]\ndir = "{tmp_path / "models"}"\n')
    done = fresh.json("install", "--no-pull")["result"]
    (note,) = [n for n in done["notes"] if "not started" in n]
    assert note.startswith(
        "b70-llamacpp.service not started: its model hf:acme/tiny-GGUF:Q4_K_M is not pulled yet"
    ), note
    assert "`sudo b70ctl models pull llamacpp` fetches it" in note
    assert "b70-llamacpp.service" not in done["started"]
    assert fresh.json("status")["result"]["active_runtime"] is None
    refused = fresh.b70ctl("switch", "llamacpp")
    assert refused.returncode == 1
    assert "runtimes.llamacpp.model: hf:acme/tiny-GGUF:Q4_K_M is not pulled yet" in refused.stderr
    assert "b70ctl models pull llamacpp" in refused.stderr


def test_a_proxy_still_starting_from_its_old_unit_is_restarted_by_an_install_that_changed_it(
    fresh: Appliance,
) -> None:
    """The proxy begun from its old unit (by the socket's first client, or the manager's boot) is
    still starting when install writes a changed unit: install restarts it, so what serves runs
    the new unit's command. A start would only have waited for the old one."""
    fresh.b70ctl("install", check=True)
    units = Path(fresh.manager.env["XDG_CONFIG_HOME"]) / "systemd" / "user"
    slow = units / "b70-litellm.service.d"
    slow.mkdir()
    (slow / "slow.conf").write_text("[Service]\nExecStartPost=/bin/sleep 12\n")
    fresh.manager.systemctl("daemon-reload")
    fresh.manager.systemctl("restart", "--no-block", "b70-litellm.service")

    def show(prop: str) -> str:
        return fresh.manager.systemctl("show", "-p", prop, "--value", "b70-litellm.service").strip()

    def command(pid: str) -> str:  # "(b70-proxy)" until systemd's child has exec'd it
        try:
            return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except (FileNotFoundError, ProcessLookupError):
            return ""

    deadline = time.monotonic() + 60
    while not (show("ActiveState") == "activating" and "--workers" in command(show("MainPID"))):
        assert time.monotonic() < deadline, f"the proxy never started again: {show('ActiveState')}"
        time.sleep(0.1)
    old = show("MainPID")
    assert "--workers 2" in command(old)

    text = fresh.config.read_text()
    fresh.config.write_text(text.replace("[proxy]\n", "[proxy]\nworkers = 1\n", 1))
    answer = fresh.json("install")
    assert "result" in answer, answer
    out = answer["result"]
    assert show("ActiveState") == "active" and "b70-litellm.service" in out["started"]
    now = show("MainPID")
    assert now != old and "--workers 1" in command(now)
    assert fresh.ask().strip()
