"""ruff and mypy run as tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, mypy_beside

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
    """mypy of the whole tree (pyproject.toml), which the collection started (tests/conftest.py)."""
    proc = mypy_beside()
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output


def test_every_tool_imports_as_a_module() -> None:
    """scripts/ runs them with `python -m b70tools.NAME`: each imports without a path hack."""
    import importlib

    for path in sorted((REPO / "b70tools").glob("*.py")):
        importlib.import_module(f"b70tools.{path.stem}")
