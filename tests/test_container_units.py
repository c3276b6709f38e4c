"""Container units under the real systemd manager, with a recording stand-in for the docker CLI.

No docker engine runs here. The stand-in records every call the unit makes (cleanup before start,
run, stop, rm) and runs the "container" as a real llama-server, so the whole unit - quoting of
argv and Environment=, the health guard following the container's pid, the cleanup - runs for real.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance import config as config_mod
from appliance.layout import MONITOR_RECORD, SAMPLES
from appliance.units import runtimes
from tests.conftest import (
    GGUF,
    LLAMA_SERVER,
    REPO,
    Appliance,
    free_port,
    installed,
    require_real_parts,
    running_manager,
    tree_snapshot,
)

IMAGE = "local/llama-server:test"
TRICKY_ENV = {
    "B70_LINEAR_FP8_RE": r"(self_attn\.(qkv_proj|o_proj)|shared_expert\.(gate_up_proj))$",
    "PERCENT": "100% sure; \"quoted\" and 'single'",
    "DOLLAR": "$HOME ${USER} $$",
}


@pytest.fixture(scope="module")
def container_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Appliance, Path]]:
    require_real_parts()
    root = tmp_path_factory.mktemp("containers")
    bindir, record = docker_standin(root)
    proxy_port, backend_port = free_port(), free_port()
    env_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in TRICKY_ENV.items())
    text = f"""
default_runtime = "llamacpp"
docker = "{bindir / "docker"}"

[proxy]
port = {proxy_port}
model = "smollm2"

[backend]
port = {backend_port}

[monitor]
port = {free_port()}

[runtimes.llamacpp]
engine = "llamacpp"
command = ["{LLAMA_SERVER}"]
model = "{GGUF}"
args = ["-c", "1024"]

[runtimes.ctr]
engine = "llamacpp"
launcher = "docker"
image = "{IMAGE}"
model = "{GGUF}"
devices = ["/dev/dri"]
shm_size = "1g"
volumes = ["/srv/models:/models:ro"]
stop_timeout_s = 10
args = ["-c", "1024", "--chat-template-kwargs", '{{"enable_thinking": false}}']

[runtimes.ctr.env]
{env_lines}

[runtimes.missing]
engine = "vllm"
launcher = "docker"
image = "local/not-pulled:1"
model = "org/model"
"""
    with running_manager(root / "manager") as manager:
        # The units' sandbox makes the file system read-only; the stand-in (not the real docker
        # CLI, which writes nothing) records its calls here, so these units may write there.
        dropin = Path(manager.env["XDG_CONFIG_HOME"]) / "systemd" / "user" / "b70-.service.d"
        dropin.mkdir(parents=True)
        (dropin / "standin.conf").write_text(f"[Service]\nBindPaths={root}\n")
        cfg = root / "appliance.toml"
        cfg.write_text(text)
        # --no-pull: the image nobody pulled stays missing, for the switch that refuses it.
        with installed(manager, cfg, proxy_port, backend_port, args=("--no-pull",)) as app:
            yield app, record


def docker_standin(root: Path) -> tuple[Path, Path]:
    """The docker stand-in in root/bin, recording its calls to root/docker-calls.jsonl."""
    bindir = root / "bin"
    bindir.mkdir()
    script = (REPO / "tests" / "standins" / "docker").read_text().split("\n", 1)[1]
    (bindir / "docker").write_text(f"#!{sys.executable}\n{script}")
    (bindir / "docker").chmod(0o755)
    record = root / "docker-calls.jsonl"
    (root / "state").mkdir()
    settings = {"record": str(record), "state": str(root / "state"), "images": [IMAGE]}
    settings["entrypoint"] = str(LLAMA_SERVER)
    (bindir / "standin.json").write_text(json.dumps(settings))
    return bindir, record


def calls(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_container_unit_runs_the_exact_argv_and_environment(
    container_app: tuple[Appliance, Path],
) -> None:
    app, record = container_app
    record.write_text("")
    app.b70ctl("switch", "ctr", check=True)
    made = calls(record)
    verbs = [c["argv"][0] for c in made]
    # Preflight looks for the image and asks for the pids of the appliance's containers (their
    # GPU memory is the appliance's own); then the unit removes a stale container of the same
    # name, runs it, and its health guard asks for the container's pid.
    assert made[0]["argv"] == ["image", "inspect", IMAGE]
    preflight = [c["argv"] for c in made[1 : verbs.index("rm")]]
    assert sorted(preflight) == [
        ["inspect", "--format", "{{.State.Pid}}", "b70-ctr"],
        ["inspect", "--format", "{{.State.Pid}}", "b70-missing"],
    ]
    unit = made[verbs.index("rm") :]
    assert [c["argv"][0] for c in unit[:3]] == ["rm", "run", "inspect"]
    assert unit[0]["argv"] == ["rm", "--force", "b70-ctr"]
    cfg = config_mod.load(app.config)
    expected = runtimes.exec_start(cfg, cfg.runtimes["ctr"])
    # systemd expands %C (the manager's cache home) in the cache folder's mount
    cache_home = app.manager.env["XDG_CACHE_HOME"]
    assert unit[1]["argv"] == [word.replace("%C", cache_home) for word in expected[1:]]
    assert f"{cache_home}/b70-ctr:/b70-cache" in unit[1]["argv"]
    # the owner's environment, and the lasting cache's variables inside the mount
    recipe = runtimes.recipe(cfg.runtimes["ctr"])
    assert unit[1]["env"] == {
        **TRICKY_ENV,
        "NEO_CACHE_DIR": f"/b70-cache/{recipe}/neo",
        "NEO_CACHE_PERSISTENT": "1",
        "SYCL_CACHE_DIR": f"/b70-cache/{recipe}/sycl",
    }
    assert app.ask().strip()

    record.write_text("")
    app.b70ctl("switch", "llamacpp", check=True)
    stopping = [c["argv"] for c in calls(record) if c["argv"][0] != "inspect"]
    # stop_timeout_s = 10 is the engine's; docker gets 10 s more before it kills (runtimes.py)
    assert stopping == [["stop", "--time", "20", "b70-ctr"], ["rm", "--force", "b70-ctr"]]


def test_a_missing_image_is_refused_before_anything_changes(
    container_app: tuple[Appliance, Path],
) -> None:
    app, _ = container_app
    app.b70ctl("switch", "llamacpp", check=True)
    before = app.json("status")["result"]["units"]
    state = Path(app.manager.env["XDG_STATE_HOME"])
    files_before = switch_files(state)
    out = app.b70ctl("switch", "missing")
    assert out.returncode == 1
    assert "runtimes.missing.image: local/not-pulled:1 is not present in docker" in out.stderr
    assert "hint: pull it first:" in out.stderr and "pull local/not-pulled:1" in out.stderr
    after = app.json("status")["result"]["units"]
    assert [(u["unit"], u["active"], u["main_pid"]) for u in after] == [
        (u["unit"], u["active"], u["main_pid"]) for u in before
    ]
    assert switch_files(state) == files_before


def switch_files(state: Path) -> dict[str, bytes]:
    """The files in the state directory; not the monitor's own (its record and its ring of
    samples), which it writes every few seconds, nor the proxy's records of the requests it
    serves (each key's usage, written within 2 s of a request's end, and the fair turns), which
    the switch before the test and the monitor's probes write."""
    return {
        k: v
        for k, v in tree_snapshot(state).items()
        if not k.endswith((MONITOR_RECORD, SAMPLES)) and not PROXY_RECORDS.search(k)
    }


PROXY_RECORDS = re.compile(r"/held/(usage/|turns-)")


def test_a_stale_server_on_the_backend_port_is_named_and_refused(
    container_app: tuple[Appliance, Path],
) -> None:
    app, _ = container_app
    app.manager.systemctl("stop", "b70-llamacpp.service", "b70-ctr.service")
    stale = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(app.backend_port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(app.backend_port)
        out = app.b70ctl("switch", "llamacpp")
        assert out.returncode == 1
        assert f"the backend port {app.backend_port} is held by pid {stale.pid}" in out.stderr
        assert "http.server" in out.stderr
        # Started by hand, the unit's own port guard refuses too: systemctl start fails.
        by_hand = subprocess.run(
            ["systemctl", "--user", "start", "b70-llamacpp.service"],
            env=app.manager.env,
            capture_output=True,
            text=True,
        )
        assert by_hand.returncode != 0
        shown = app.manager.systemctl("show", "-p", "ActiveState,SubState,Result", "b70-llamacpp")
        props = dict(line.split("=", 1) for line in shown.splitlines())
        # Restart=on-failure may already be waiting to try again; it never became active.
        assert props["SubState"] in {"failed", "auto-restart"}, props
        assert props["Result"] == "exit-code", props
        app.manager.systemctl("stop", "b70-llamacpp.service")
    finally:
        stale.terminate()
        stale.wait()
    app.b70ctl("switch", "llamacpp", check=True)
    assert app.ask().strip()


def _wait_listening(port: int) -> None:
    import socket
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def test_uninstall_stops_and_removes_everything_and_can_run_twice(
    container_app: tuple[Appliance, Path],
) -> None:
    app, _ = container_app
    config_home = Path(app.manager.env["XDG_CONFIG_HOME"])
    assert (config_home / "systemd" / "user" / "b70-ctr.service").exists()
    out = app.b70ctl("uninstall")
    assert out.returncode == 0, out.stderr
    assert not list((config_home / "systemd" / "user").glob("b70-*.service"))
    assert not (config_home / "b70" / "litellm.yaml").exists()
    assert (config_home / "b70" / "proxy.env").exists()  # kept without --purge
    for unit in ("b70-llamacpp.service", "b70-ctr.service", "b70-litellm.service"):
        assert app.manager.systemctl("is-active", unit).strip() == "inactive"
    cache = Path(app.manager.env["XDG_CACHE_HOME"]) / "b70-litellm"
    assert cache.is_dir(), "the proxy's CacheDirectory= (kept without --purge)"
    again = app.b70ctl("uninstall", "--purge")
    assert again.returncode == 0, again.stderr
    assert not (config_home / "b70" / "proxy.env").exists()
    assert not cache.exists()
