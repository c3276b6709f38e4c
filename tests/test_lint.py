"""ruff and mypy run as tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

BIN = Path(sys.executable).parent


def test_ruff() -> None:
    out = subprocess.run(
        [str(BIN / "ruff"), "check", "appliance", "b70tools", "tests", "scripts"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy() -> None:
    out = subprocess.run([str(BIN / "mypy")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_tool_imports_as_a_module() -> None:
    """scripts/ runs them with `python -m b70tools.NAME`: each imports without a path hack."""
    import importlib

    for path in sorted((REPO / "b70tools").glob("*.py")):
        importlib.import_module(f"b70tools.{path.stem}")
