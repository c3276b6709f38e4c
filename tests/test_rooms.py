"""The rooms of appliance/ and the direction of imports between them, read from the code's own
imports (those inside functions too): no room imports one above it, the proxy stands alone,
and no module takes part in a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "appliance"

# Each room and the rooms below it, lowest first. A room may import itself and any room of a
# lower rank; rooms of one rank do not import each other. "core" is the modules at the top of
# appliance/ (apis, errors, files, hold, keyorder, keys, layout, people, run, usage).
RANKS: dict[str, int] = {
    "core": 0,
    "config": 1,
    "engines": 2,
    "host": 3,
    "units": 4,
    "measure": 5,
    "switch": 6,
    "deploy": 7,
    "watch": 7,
    "cli": 8,
}
# What LiteLLM loads runs beside the controller, not on top of it: it imports the core alone,
# and nothing imports it (the proxy's config is rendered from data, not from its code).
PROXY = "proxy"
MOST_MODULES = 10  # in any one folder, its __init__ aside
MOST_LINES = 500  # in any one module


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "core"  # appliance itself
    return parts[1] if (PACKAGE / parts[1]).is_dir() else "core"


def imports(module: str, path: Path, known: set[str]) -> Iterator[str]:
    """The appliance modules `module` imports, anywhere in it."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from a.b import c` imports a.b.c when c is a module, and a.b otherwise (a
            # package's __init__ that runs first is not counted: it is how Python finds c)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            names = subs if len(subs) == len(node.names) else [base, *subs]
        else:
            continue
        for name in names:
            if name in known and name != module:
                yield name


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {m: set(imports(m, p, known)) for m, p in found.items()}


def test_every_room_is_known_and_small() -> None:
    rooms = {room_of(m) for m in modules()}
    assert rooms <= set(RANKS) | {PROXY}, rooms - set(RANKS) - {PROXY}
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        mods = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(mods) <= MOST_MODULES, f"{folder.relative_to(PACKAGE.parent)}: {len(mods)}"
    long = {str(p.relative_to(PACKAGE.parent)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MOST_LINES}  # fmt: skip
    assert not long, f"modules over {MOST_LINES} lines: {long}"


def test_each_room_says_what_it_is_for_and_what_it_may_import() -> None:
    for room in [*(r for r in RANKS if r != "core"), PROXY]:
        doc = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text()))
        assert doc and "May import" in doc, f"appliance/{room}/__init__.py"


def test_no_room_imports_one_above_it_or_beside_it() -> None:
    wrong = []
    for module, targets in graph().items():
        here = room_of(module)
        for target in targets:
            there = room_of(target)
            if there == here or target == "appliance":
                continue
            if PROXY in (here, there):
                allowed = here == PROXY and there == "core"
            else:
                allowed = RANKS[there] < RANKS[here]
            if not allowed:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    assert wrong == []


def test_the_core_imports_only_the_standard_library_at_its_top() -> None:
    """The core is what every room stands on (the proxy too, inside LiteLLM's process): its
    modules import no third-party package at their top, so that every command starts fast."""
    wrong = []
    for module, path in modules().items():
        if room_of(module) != "core":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in {"appliance", "__future__"} and top not in STDLIB:
                    wrong.append(f"{module}: {name}")
    assert wrong == []


STDLIB = frozenset(__import__("sys").stdlib_module_names)


def test_no_module_takes_part_in_a_cycle() -> None:
    """Tarjan's strongly connected components over every import, those inside functions too."""
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert cycles == []


def test_every_package_is_in_the_wheel() -> None:
    """pyproject.toml lists the packages the wheel holds: a package left out is missing where the
    appliance is installed from its wheel (the system box), though an editable install finds it."""
    import tomllib

    listed = set(
        tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"][
            "packages"
        ]
    )
    found = {module_name(p) for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts}
    assert found <= listed, found - listed
