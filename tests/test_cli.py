"""The command line: every command has help with an example and is in the README."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from appliance.cli import cli
from tests.conftest import REPO

COMMANDS = sorted(name for name, cmd in cli.commands.items() if not cmd.hidden)


def test_the_public_commands() -> None:
    assert COMMANDS == [
        "bench",
        "gate",
        "gpu",
        "install",
        "logs",
        "monitor",
        "plan",
        "render",
        "status",
        "switch",
        "uninstall",
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
