"""ruff and mypy run as tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

BIN = Path(sys.executable).parent


def test_ruff() -> None:
    out = subprocess.run(
        [str(BIN / "ruff"), "check", "appliance", "tests", "scripts"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy() -> None:
    out = subprocess.run([str(BIN / "mypy")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
