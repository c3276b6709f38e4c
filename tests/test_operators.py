"""Who may do what on a system install, checked as a second account that is not root (the
`nobody` user): the commands that change the appliance refuse with the way to do it, and the
journal names the group to join. The same account on a booted system manager runs the commands
that only read (tests/test_system_box_real.py)."""

from __future__ import annotations

import json
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import B70CTL, REPO

NOBODY = pwd.getpwnam("nobody")


def as_nobody(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to run as a second account"
    argv = [setpriv, f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups"]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    return subprocess.run(
        [*argv, B70CTL, "--config", str(config), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def config() -> Iterator[Path]:
    """examples/b70.toml where any account can read it (pytest's own folders are root's)."""
    folder = Path(tempfile.mkdtemp(prefix="b70-operators-"))
    try:
        folder.chmod(0o755)
        path = folder / "appliance.toml"
        path.write_text((REPO / "examples" / "b70.toml").read_text())
        path.chmod(0o644)
        yield path
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize(
    "args",
    [
        ["switch", "llamacpp"],
        ["install"],
        ["uninstall", "--purge"],
        ["monitor", "--once"],
        ["gate"],
    ],
    ids=lambda a: a[0],
)
def test_what_changes_the_appliance_is_roots_and_says_how(config: Path, args: list[str]) -> None:
    out = as_nobody(*args, "--json", config=config)
    assert out.returncode == 1, out.stderr
    error = json.loads(out.stdout)["error"]
    assert error["code"] == "not_permitted"
    assert f"`b70ctl {args[0]}` changes the appliance: only root may run it" in error["message"]
    assert "sudo b70ctl" in error["hint"] and "docs/security.md" in error["hint"]
    assert "Permission denied" not in out.stdout + out.stderr
    assert "Traceback" not in out.stderr


def test_the_journal_names_the_group_to_join(config: Path) -> None:
    out = as_nobody("logs", "llamacpp", config=config)
    assert out.returncode == 1
    assert "systemd-journal group" in out.stderr
    assert "usermod -aG systemd-journal" in out.stderr


def test_commands_that_only_read_need_no_root(config: Path) -> None:
    """plan and render read files the account may read; nothing is written."""
    fixture = REPO / "tests" / "fixtures" / "hybrid-moe-config.json"
    out = as_nobody("plan", str(fixture), "--json", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["ok"] is True
    out = as_nobody("render", "--json", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
