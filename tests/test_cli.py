"""The command line: every command has help with an example and is in the README."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from appliance.cli import cli
from tests.conftest import B70CTL, REPO

COMMANDS = sorted(name for name, cmd in cli.commands.items() if not cmd.hidden)


def test_the_public_commands() -> None:
    assert COMMANDS == [
        "bench",
        "doctor",
        "gate",
        "gpu",
        "install",
        "keys",
        "logs",
        "models",
        "monitor",
        "plan",
        "render",
        "setup",
        "status",
        "switch",
        "uninstall",
        "unpin",
        "usage",
    ]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_with_an_example(name: str) -> None:
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0
    assert "Example:" in result.output and "b70ctl" in result.output


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_is_in_the_readme(name: str) -> None:
    assert f"b70ctl {name}" in (REPO / "README.md").read_text() or f" {name} " in _readme_commands()


def _readme_commands() -> str:
    return (
        " ".join(line for line in (REPO / "README.md").read_text().splitlines() if "b70ctl" in line)
        + " "
    )


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["swtich", "vllm"])
    assert result.exit_code == 2
    assert "No such command 'swtich'" in result.stderr


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and "version" in result.output
    assert isinstance(cli, click.Group)


def _all_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        out.append((*prefix, name))
        if isinstance(cmd, click.Group):
            out += _all_commands(cmd, (*prefix, name))
    return out


# Every command, with the arguments it needs; each is run against broken inputs below.
ARGS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("bench",): (),
    ("doctor",): (),
    ("gate",): (),
    ("gpu",): (),
    ("gpu", "wait-free"): ("--need-gib", "1", "--timeout", "0"),
    ("install",): (),
    ("keys",): (),
    ("keys", "add"): ("alice",),
    ("keys", "list"): (),
    ("keys", "revoke"): ("alice",),
    ("keys", "rotate"): ("alice",),
    ("logs",): ("vllm",),
    ("models",): (),
    ("models", "list"): (),
    ("models", "pull"): (),
    ("models", "rm"): ("vllm",),
    ("monitor",): ("--once",),
    ("plan",): ("CONFIG_JSON",),
    ("render",): (),
    ("setup",): ("--dry-run",),
    ("status",): (),
    ("switch",): ("vllm",),
    ("uninstall",): (),
    ("unpin",): (),
    ("usage",): (),
    ("unit",): (),
    ("unit", "pre"): ("--port", "1"),
    ("unit", "ready"): ("--url", "http://127.0.0.1:1", "--engine", "llamacpp", "--pid", "4194304"),
}


def test_the_json_table_covers_every_command() -> None:
    assert sorted(ARGS) == _all_commands(cli)


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [B70CTL, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _envelope(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)  # exactly one document
    assert doc["version"] == 1
    return doc


@pytest.fixture
def broken(tmp_path: Path) -> dict[str, Path]:
    """Broken inputs: configs that are not UTF-8, not TOML, a directory, unreadable JSON."""
    (tmp_path / "latin1.toml").write_bytes(b'default_runtime = "x\xe9"\n')
    (tmp_path / "syntax.toml").write_text("default_runtime = \n")
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "inf.toml").write_text(
        'default_runtime = "vllm"\n[runtimes.vllm]\nengine = "vllm"\nmodel = "/m"\n'
        "start_timeout_s = inf\n"
    )
    (tmp_path / "plan.json").write_bytes(b"\xff\xfe{")
    return {p.stem: p for p in tmp_path.iterdir()}


def _in_process(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    """b70ctl's console script called in this process (a process start costs a second here);
    the same function the executable runs, with its exit code, stdout and stderr."""
    from appliance.cli import main

    with monkeypatch.context() as m:
        m.setattr(sys, "stdin", io.StringIO())
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


@pytest.mark.parametrize("command", sorted(ARGS), ids=" ".join)
@pytest.mark.parametrize("config_name", ["latin1", "syntax", "dir", "inf"])
def test_every_command_with_json_prints_the_envelope_on_broken_input(
    command: tuple[str, ...],
    config_name: str,
    broken: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("B70_SYSROOT", str(tmp_path / "no-such-root"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    args = [a if a != "CONFIG_JSON" else str(broken["plan"]) for a in ARGS[command]]
    argv = ["--user", "--config", str(broken[config_name]), *command, *args, "--json"]
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    if command in {("unit",), ("keys",)}:
        argv = [command[0], "--json"]  # a group without a command of its own: a usage error
    out = _in_process(argv, monkeypatch, capsys)
    doc = _envelope(out)
    if command in {("gpu",), ("gpu", "wait-free"), ("unit", "pre")}:
        # These read no config: with no GPU (and a free port) they succeed.
        assert out.returncode == 0 and doc["ok"] is True, out.stdout
        return
    assert out.returncode != 0 and doc["ok"] is False
    assert doc["error"]["message"] and doc["error"]["code"]
    assert out.stderr == "" or "Traceback" not in out.stderr


@pytest.mark.parametrize("config_name", ["latin1", "syntax", "dir", "inf"])
def test_the_executable_prints_the_envelope_on_broken_input_too(
    config_name: str, broken: dict[str, Path], tmp_path: Path
) -> None:
    """The same as above, through the installed executable (one command per kind of input)."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    out = _run(["--user", "--config", str(broken[config_name]), "status", "--json"], env)
    doc = _envelope(out)
    assert out.returncode != 0 and doc["ok"] is False and doc["error"]["code"]


def test_usage_errors_with_json_are_envelopes_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _in_process(["switch", "--json"], monkeypatch, capsys)
    doc = _envelope(out)
    assert out.returncode == 2 and doc["ok"] is False
    assert doc["error"]["code"] == "usage_error"
    assert "Missing argument 'NAME'" in doc["error"]["message"]
    out = _in_process(["logs", "vllm", "-n", "x", "--json"], monkeypatch, capsys)
    assert _envelope(out)["error"]["code"] == "usage_error" and out.returncode == 2


def test_an_os_error_is_an_error_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    good = REPO / "examples" / "b70.toml"
    out = _in_process(["--config", str(good), "render", "--out", "/proc/x"], monkeypatch, capsys)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: /proc/x") and "hint: " in out.stderr
    doc = _envelope(
        _in_process(
            ["--config", str(good), "render", "--out", "/proc/x", "--json"], monkeypatch, capsys
        )
    )
    assert doc["ok"] is False and doc["error"]["code"] == "os_error"


def test_a_reader_that_leaves_gets_no_error_and_the_exit_of_sigpipe() -> None:
    """`b70ctl render | head -1` where head has gone before b70ctl writes: no 'error: Broken
    pipe' with a hint about free space, no traceback; the exit status a SIGPIPE would give."""
    child = subprocess.Popen(
        [B70CTL, "--config", str(REPO / "examples" / "b70.toml"), "render"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # before b70ctl has started, let alone written
    err = child.stderr.read().decode()
    assert child.wait(60) == 141, err
    assert err == ""


def test_a_batch_priority_without_fair_turns_is_refused_before_a_key_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.configs import GOOD

    config = tmp_path / "appliance.toml"
    config.write_text(GOOD.replace('model = "smollm2"', 'model = "smollm2"\nfair = false', 1))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    argv = ["--user", "--config", str(config), "keys", "add", "bob", "--priority", "batch"]
    out = _in_process(argv, monkeypatch, capsys)
    assert out.returncode == 2, out
    assert "--priority batch does nothing here: [proxy] fair = false" in out.stderr
    assert not (tmp_path / "state").exists() or not list((tmp_path / "state").rglob("keys.json"))
