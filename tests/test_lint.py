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


def test_the_proxy_package_imports_nothing_else_of_the_appliance() -> None:
    """What LiteLLM loads (appliance/proxy/) stands alone: the proxy's user and sandbox see it
    alone, and a change elsewhere in the controller cannot break the door."""
    import ast

    outside = []
    for path in sorted((REPO / "appliance" / "proxy").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("appliance.") and not name.startswith("appliance.proxy"):
                    outside.append(f"{path.name}: {name}")
    assert outside == []


def test_every_tool_imports_as_a_module() -> None:
    """scripts/ runs them with `python -m b70tools.NAME`: each imports without a path hack."""
    import importlib

    for path in sorted((REPO / "b70tools").glob("*.py")):
        importlib.import_module(f"b70tools.{path.stem}")
