"""The --json contract on good input: every command, run against the real appliance, prints one
document, {"version": 1, "ok": true, "result": {...}}, whose result has the keys scripts rely on.
tests/test_cli.py holds the same contract for broken input."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from b70tools import gpu_trees
from b70tools.net import free_port
from tests.conftest import REPO, Appliance, demo_config_text, require_real_parts, running_manager
from tests.test_cli import ARGS

PLAN_CONFIG = REPO / "tests" / "fixtures" / "hybrid-moe-config.json"


def serving(app: Appliance) -> tuple[str, dict[str, Any]]:
    status = app.json("status")["result"]
    name = status["active_runtime"]
    assert name, status
    (unit,) = [u for u in status["units"] if u["unit"] == f"b70-{name}.service"]
    return name, unit


def made(app: Appliance, name: str) -> str:
    """A person's key of that name, made now if there is none."""
    app.b70ctl("keys", "add", name)  # refused when it exists: either way it is there
    return name


# Each command: its arguments (given the appliance and a scratch directory), and the keys its
# result must have. install and uninstall are below, on an appliance of their own.
Args = Callable[[Appliance, Path], list[str]]
GOOD: dict[tuple[str, ...], tuple[Args, set[str]]] = {
    ("render",): (lambda app, tmp: [], {"files"}),
    ("switch",): (
        lambda app, tmp: [serving(app)[0]],
        {"target", "previous", "ok", "seconds", "phases", "notes", "answer", "rolled_back"},
    ),
    ("status",): (
        lambda app, tmp: [],
        {"scope", "active_runtime", "units", "backend", "proxy", "hold", "last_switch", "demand"},
    ),
    ("monitor",): (lambda app, tmp: ["--once"], {"runtime", "failovers", "last_observation"}),
    ("logs",): (lambda app, tmp: [serving(app)[0], "-n", "5"], {"unit", "lines"}),
    ("plan",): (
        lambda app, tmp: [str(PLAN_CONFIG), "--tokens", "1024"],
        {"weight_bytes", "requests_fit", "steps"},
    ),
    ("gate",): (lambda app, tmp: ["--json-requests", "1"], {"runtime", "ok", "checks"}),
    ("bench",): (
        lambda app, tmp: [
            *("--requests", "2", "--concurrency", "1", "--input-tokens", "16"),
            *("--output-tokens", "4", "--out", str(tmp / "bench.json")),
        ],
        {"result_file"},
    ),
    ("gpu",): (lambda app, tmp: [], {"devices"}),
    ("gpu", "wait-free"): (
        lambda app, tmp: ["--need-gib", "0", "--timeout", "0"],
        {"devices", "need_bytes", "free"},
    ),
    ("unpin",): (lambda app, tmp: [], {"unpinned"}),
    ("keys", "add"): (lambda app, tmp: [f"json-{tmp.name[-12:]}"], {"name", "key", "priority"}),
    ("keys", "list"): (lambda app, tmp: [], {"keys"}),
    ("keys", "rotate"): (lambda app, tmp: [made(app, "json-rotate")], {"name", "key"}),
    ("keys", "revoke"): (lambda app, tmp: [made(app, "json-revoke")], {"revoked"}),
    ("usage",): (lambda app, tmp: ["--since", "1h"], {"since", "keys"}),
    ("models", "list"): (lambda app, tmp: [], {"models"}),
    ("setup",): (
        lambda app, tmp: [
            "--dry-run",
            "--root",
            str(gpu_trees.healthy_host(tmp / "root", [gpu_trees.B70])),
        ],
        {"path", "text", "written", "kept", "left_out"},
    ),
    ("unit", "pre"): (lambda app, tmp: ["--port", str(free_port())], {"port", "free"}),
    ("unit", "ready"): (
        lambda app, tmp: [
            *("--url", f"http://127.0.0.1:{app.backend_port}"),
            *("--engine", serving(app)[0], "--pid", str(serving(app)[1]["main_pid"])),
        ],
        {"url", "ready"},
    ),
}


def test_the_table_covers_every_command_that_has_a_result() -> None:
    groups = {("unit",), ("keys",), ("models",)}  # no command of their own: a usage error
    # doctor fails on this appliance's broken runtime, as it should: tests/test_doctor.py runs
    # it on a healthy host of its own and checks the envelope there. This appliance has no model
    # on the hub: tests/test_hub.py pulls and removes them, with --json, from a local hub.
    own = {("install",), ("uninstall",), ("doctor",), ("models", "pull"), ("models", "rm")}
    assert set(GOOD) | own | groups == set(ARGS)


def envelope(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)  # exactly one document
    assert set(doc) == {"version", "ok", "result"}
    assert doc["version"] == 1 and doc["ok"] is True
    assert isinstance(doc["result"], dict)
    return doc["result"]


@pytest.mark.parametrize("command", sorted(GOOD), ids=" ".join)
def test_every_command_prints_its_result_in_the_envelope(
    command: tuple[str, ...], appliance: Appliance, tmp_path: Path
) -> None:
    args, keys = GOOD[command]
    result = envelope(appliance.b70ctl(*command, *args(appliance, tmp_path), "--json"))
    assert keys <= set(result), f"missing: {keys - set(result)}"


def test_install_and_uninstall_print_theirs(tmp_path: Path) -> None:
    require_real_parts()
    with running_manager(tmp_path / "manager") as manager:
        config = tmp_path / "appliance.toml"
        config.write_text(demo_config_text(free_port(), free_port()))
        app = Appliance(manager, config, 0, 0)
        try:
            installed = envelope(app.b70ctl("install", "--no-now", "--json"))
            assert {"written", "unchanged", "enabled", "started", "boot_runtime"} <= set(installed)
            assert installed["started"] == []
        finally:
            removed = envelope(app.b70ctl("uninstall", "--purge", "--json"))
        assert removed["removed"]
