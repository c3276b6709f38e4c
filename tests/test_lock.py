"""The locks in requirements/ (docs/dependencies.md): what is installed is what they hold, they
agree with pyproject.toml, they hold no compromised release, and every file in them is hashed."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

from tests.conftest import REPO

RUNTIME_LOCK = REPO / "requirements" / "runtime.lock"
TEST_LOCK = REPO / "requirements" / "test.lock"
# Compromised LiteLLM releases; requirements/constraints.txt keeps them out of scripts/lock's
# resolution too.
COMPROMISED_LITELLM = {"1.82.7", "1.82.8", "1.107.0"}
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}\b")


@dataclass(frozen=True)
class Locked:
    requirement: Requirement
    hashes: int
    line: int

    @property
    def name(self) -> NormalizedName:
        return canonicalize_name(self.requirement.name)

    @property
    def version(self) -> str:
        """The exact version: each entry of a lock is name==version."""
        (spec,) = self.requirement.specifier
        assert spec.operator == "==", f"{self.requirement} is not exact"
        return spec.version


@cache
def read_lock(path: Path) -> dict[NormalizedName, Locked]:
    """Each requirement of a lock in pip's format, its continuation lines joined, comments and
    options left out."""
    entries: dict[NormalizedName, Locked] = {}
    logical, first = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        text = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not logical:
            first = number
        if text.endswith("\\"):
            logical += text[:-1] + " "
            continue
        logical += text
        if logical.strip() and not logical.startswith("-"):
            spec = logical.split("--hash=", 1)[0].strip()
            entry = Locked(Requirement(spec), len(HASH.findall(logical)), first)
            assert entry.name not in entries, f"{path.name}:{first}: {entry.name} twice"
            entries[entry.name] = entry
        logical = ""
    return entries


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def pyproject_requirements(group: str | None) -> list[Requirement]:
    """[project] dependencies, or those of one optional group."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    texts = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return [Requirement(text) for text in texts]


def test_the_locks_hold_packages() -> None:
    """A parser that found nothing would make every test below pass."""
    runtime, test = read_lock(RUNTIME_LOCK), read_lock(TEST_LOCK)
    assert {"litellm", "pystemd", "starlette", "fastapi"} <= runtime.keys()
    assert {"pytest", "mypy", "ruff"} <= test.keys() - runtime.keys()


def test_what_is_installed_is_what_the_locks_hold() -> None:
    """Every package of the runtime lock is installed at its locked version; so is every package
    of the test lock that is installed at all (scripts/bootstrap without --test leaves them out)."""
    runtime, test = read_lock(RUNTIME_LOCK), read_lock(TEST_LOCK)
    wrong = []
    for entry in [*runtime.values(), *(e for n, e in test.items() if n not in runtime)]:
        if entry.requirement.marker and not entry.requirement.marker.evaluate():
            continue  # not for this Python
        have = installed(entry.name)
        if have is None and entry.name not in runtime:
            continue
        if have is None or Version(have) != Version(entry.version):
            lock = RUNTIME_LOCK if entry.name in runtime else TEST_LOCK
            wrong.append(
                f"{entry.name}: installed {have or 'nothing'}, locked {entry.version} "
                f"(requirements/{lock.name})"
            )
    assert not wrong, (
        "this environment is not the locked one:\n  "
        + "\n  ".join(wrong)
        + "\nrun scripts/bootstrap (--test for the test set) to install the locks, "
        "or scripts/lock to move the locks to new versions"
    )


def test_pyproject_and_the_locks_agree() -> None:
    """Every requirement of pyproject.toml is in the lock of its set, at a version it allows, and
    each exact pin (==) is the locked version. The test lock holds the runtime lock as it is."""
    runtime, test = read_lock(RUNTIME_LOCK), read_lock(TEST_LOCK)
    wrong = []
    for group, path in [(None, RUNTIME_LOCK), ("test", TEST_LOCK)]:
        lock = read_lock(path)
        for req in pyproject_requirements(group):
            entry = lock.get(canonicalize_name(req.name))
            if entry is None:
                wrong.append(f"{req} is not in {path.name}")
            elif not req.specifier.contains(entry.version, prereleases=True):
                pin = "pins" if any(s.operator == "==" for s in req.specifier) else "asks for"
                wrong.append(
                    f"{entry.name}: pyproject.toml {pin} {req.specifier}, "
                    f"{path.name} has {entry.version}"
                )
    for name, entry in runtime.items():
        other = test.get(name)
        if other is None or other.version != entry.version:
            wrong.append(
                f"{name}: runtime.lock has {entry.version}, "
                f"test.lock {other.version if other else 'nothing'}"
            )
    assert not wrong, "\n".join(wrong) + "\nrun scripts/lock --keep, then scripts/bootstrap --test"


def test_the_locks_hold_no_compromised_litellm() -> None:
    for path in (RUNTIME_LOCK, TEST_LOCK):
        litellm = read_lock(path).get(canonicalize_name("litellm"))
        assert litellm is None or litellm.version not in COMPROMISED_LITELLM, (
            f"{path.name}:{litellm.line}: litellm {litellm.version} was a compromised release"
        )


def test_every_locked_requirement_has_a_hash() -> None:
    """pip's --require-hashes refuses a lock with one unhashed line; this says which."""
    unhashed = [
        f"{path.name}:{entry.line}: {entry.requirement}"
        for path in (RUNTIME_LOCK, TEST_LOCK)
        for entry in read_lock(path).values()
        if entry.hashes == 0
    ]
    assert not unhashed, "no --hash=sha256: for\n" + "\n".join(unhashed)
