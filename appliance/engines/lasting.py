"""A lasting cache for each runtime: what its engine compiles at a start, kept across stops.

Each runtime unit has a cache folder of its own (systemd's CacheDirectory=: /var/cache/b70-NAME
on the system manager, ~/.cache/b70-NAME on a user's), owned by the runtime's user. Inside it, a
folder per recipe, named by a fingerprint of everything that makes the runtime what it is (its
engine, launcher, image, command, model, arguments and environment), so that a different image,
version, model or recipe never loads another's artifacts. The engine's cache variables
(appliance.engines) point into that folder: on the host for a runtime run natively, at
`CONTAINER_ROOT` in a container, where the runtime's cache folder is mounted.

Before each start, the unit's guard (`prepare`) makes the folders, keeps the runtime's caches
under their size bound (the least recently used recipe first, then the oldest of what the
current recipe keeps), and says in one line whether the start finds anything. A folder that
cannot be written, or a disk too full for a start's artifacts, never fails the start: the guard
writes an environment file (the unit's EnvironmentFile=, in its RuntimeDirectory=) that points
the variables at throwaway folders, and the start is cold and says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.config import RuntimeConfig
from appliance.engines.facts import EngineFacts, StartCache

RECIPE = re.compile(r"[0-9a-f]{12}")  # a recipe's folder: the fingerprint's first 12 hex digits
STAMP = ".b70-used"  # in a recipe's folder; its mtime is when a start last used the folder
STARTED = ".b70-started"  # in a recipe's folder: a start of the recipe succeeded with it
CONTAINER_ROOT = "/b70-cache"  # where a container sees its runtime's cache folder
COLD_ROOT = "/tmp/b70-cold-cache"  # the throwaway folders of a start that keeps nothing
ENV_FILE = "cache.env"  # in the unit's RuntimeDirectory=
FREE_FLOOR_BYTES = 1024**3  # a start may write this much; below it, the start keeps nothing
LINE = "b70 cache:"  # the guard's one line in the unit's journal


def fingerprint(
    runtime: RuntimeConfig, args: Iterable[str] = (), env: Mapping[str, str] = {}
) -> str:
    """The recipe's name: a hash of what makes the runtime's artifacts what they are. `args`,
    `env`: what its cards add (appliance.host.placement). Its port and served name are left
    out: they change nothing it compiles."""
    recipe = {
        "engine": runtime.engine.value,
        "launcher": runtime.launcher.value,
        "image": runtime.image,
        "command": list(runtime.command),
        "model": runtime.model,
        "mmproj": runtime.mmproj,
        "args": [*runtime.args, *args],
        "env": {**runtime.env, **env},
    }
    text = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def engine_env(facts: EngineFacts, where: str, taken: Collection[str] = ()) -> dict[str, str]:
    """Each cache variable the appliance sets, pointing into `where` (the recipe's folder as the
    engine sees it); a variable in `taken` (the config sets it itself) is left to the config."""
    out = {}
    for var in facts.caches:
        if var.name not in taken:
            out[var.name] = f"{where}/{var.folder}" if var.folder else var.value
    return out


def cold_env(facts: EngineFacts, names: Collection[str]) -> dict[str, str]:
    """What a start that must keep nothing runs with: the appliance's folder variables among
    `names` at throwaway folders, and the engine's own switches off."""
    out = {name: f"{COLD_ROOT}/{folder}" for name, folder in facts.folders.items() if name in names}
    return {**out, **facts.cold_env}


# --- before a start --------------------------------------------------------------------------


@dataclass
class Prepared:
    """What the guard found and did before a start."""

    verdict: str  # "warm": it holds an earlier start's artifacts; "cold": it does not, or
    # cannot be used (`problem`); "none": earlier starts kept nothing (nothing compiles here)
    folder: Path
    held_bytes: int = 0
    problem: str = ""
    dropped: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        if self.problem:
            return f"{LINE} cold: {self.folder} {self.problem}; this start keeps nothing"
        if self.verdict == "warm":
            return f"{LINE} warm: {self.folder} holds {mib(self.held_bytes)} from earlier starts"
        if self.verdict == "none":
            return (
                f"{LINE} none: {self.folder} is empty after earlier starts: nothing compiles here"
            )
        return f"{LINE} cold: {self.folder} holds nothing yet; this start fills it"


def prepare(
    folder: Path,
    facts: EngineFacts,
    names: Collection[str],
    max_bytes: int,
    env_file: Path | None,
) -> Prepared:
    """Make the recipe's folders, keep the runtime's caches under `max_bytes`, and write the
    environment file of the start (empty where the folder serves; the throwaway folders where it
    cannot). `names`: the variables the unit points at the folder."""
    problem = "is off (cache_max_gib = 0)" if max_bytes == 0 else usable(folder, facts)
    if problem:
        _write_env(env_file, cold_env(facts, names))
        return Prepared("cold", folder, problem=problem)
    dropped = bound(folder.parent, max_bytes, keep=folder, facts=facts)
    with contextlib.suppress(OSError):
        (folder / STAMP).touch()
    _write_env(env_file, {})
    held = size_of(folder)
    verdict = "warm" if is_warm(folder, facts) else "none" if was_started(folder) else "cold"
    return Prepared(verdict, folder, held, dropped=dropped)


def usable(folder: Path, facts: EngineFacts) -> str:
    """Why a start cannot keep its artifacts in `folder`, or "" when it can."""
    try:
        for sub in facts.folders.values():
            (folder / sub).mkdir(parents=True, exist_ok=True)
        probe = folder / f".b70-probe-{os.getpid()}"  # tempfile costs a start 5 ms to import
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        probe.unlink()
        stat = os.statvfs(folder)
    except OSError as e:
        return f"cannot be written ({e.strerror or e})"
    free = stat.f_bavail * stat.f_frsize
    if free < FREE_FLOOR_BYTES:
        floor = mib(FREE_FLOOR_BYTES)
        return f"has {mib(free)} free on its disk, less than the {floor} a start may write"
    return ""


def _write_env(path: Path | None, env: Mapping[str, str]) -> None:
    """The unit's EnvironmentFile=: the start reads it after this guard (systemd reads each
    environment file as the next command starts). Written whole or not at all."""
    if path is None:
        return
    from appliance.files import write_atomic

    text = "".join(f"{k}={v}\n" for k, v in sorted(env.items()))
    with contextlib.suppress(OSError):
        write_atomic(path, text, mode=0o600)


def mib(n: int) -> str:
    return f"{n / 1024**2:.1f} MiB" if n < 1024**3 else f"{n / 1024**3:.2f} GiB"


# --- what a cache holds ---------------------------------------------------------------------


def size_of(path: Path) -> int:
    """Bytes under `path`, never following a link."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def newest(path: Path) -> float:
    """When a file under `path` (or `path`, a file) was last written; an empty folder's own time.
    A folder's time changes whenever an entry is added, so only files count."""
    try:
        own = os.lstat(path).st_mtime
    except OSError:
        return 0.0
    latest = None
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                t = os.lstat(os.path.join(root, name)).st_mtime
                latest = t if latest is None else max(latest, t)
    return own if latest is None else latest


def is_warm(folder: Path, facts: EngineFacts) -> bool:
    """Whether the recipe's folder holds what only a start that compiled leaves."""
    return any(next(folder.glob(pattern), None) is not None for pattern in facts.warm_globs)


def recipes(root: Path) -> list[Path]:
    """The recipes' folders in a runtime's cache folder: only folders the appliance names."""
    if not root.is_dir() or root.is_symlink():
        return []
    return sorted(
        p for p in root.iterdir() if RECIPE.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    )


def last_used(folder: Path) -> float:
    try:
        return (folder / STAMP).stat().st_mtime
    except OSError:
        return newest(folder)


def _remove(path: Path) -> bool:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()
    return not path.exists() and not path.is_symlink()


def entries(folder: Path, facts: EngineFacts) -> list[Path]:
    """What the current recipe keeps, in the pieces that can go one by one: each artifact the
    warm patterns name (vLLM's compile folders), and each entry of every cache variable's folder
    that holds none of those."""
    found = {p for pattern in facts.warm_globs for p in folder.glob(pattern)}
    for sub in facts.folders.values():
        with contextlib.suppress(OSError):
            for child in (folder / sub).iterdir():
                if not any(str(p).startswith(str(child) + "/") or p == child for p in found):
                    found.add(child)
    return sorted(found)


def bound(root: Path, max_bytes: int, keep: Path, facts: EngineFacts) -> list[str]:
    """Keep a runtime's cache folder under `max_bytes`: drop the least recently used recipes
    first (never `keep`, the one starting), then the oldest of what `keep` holds. Returns what
    was dropped, with its size."""
    dropped: list[str] = []
    sizes = {p: size_of(p) for p in recipes(root)}
    total = sum(sizes.values())
    for folder in sorted((p for p in sizes if p != keep), key=last_used):
        if total <= max_bytes:
            return dropped
        if _remove(folder):
            total -= sizes[folder]
            dropped.append(f"{folder.name} ({mib(sizes[folder])})")
    if total <= max_bytes or not keep.is_dir():
        return dropped
    for entry in sorted(entries(keep, facts), key=newest):
        if total <= max_bytes:
            break
        n = size_of(entry) if entry.is_dir() else os.lstat(entry).st_blocks * 512
        if _remove(entry):
            total -= n
            dropped.append(f"{entry.relative_to(root)} ({mib(n)})")
            _remove(keep / STARTED)  # it holds less than its starts left: not warm for sure
    return dropped


def prune(root: Path, keep: Collection[str]) -> list[Path]:
    """Remove the folders of recipes no longer installed (not in `keep`, by name)."""
    return [p for p in recipes(root) if p.name not in keep and _remove(p)]


@dataclass(frozen=True)
class CacheState:
    """A recipe's folder as doctor shows it. started: a start of the recipe succeeded with it;
    readable: False where the folder is its runtime user's alone (not root's)."""

    folder: Path
    held_bytes: int
    started: bool
    readable: bool = True


def state(folder: Path) -> CacheState:
    try:
        if not folder.is_dir():
            return CacheState(folder, 0, False)
        return CacheState(folder, size_of(folder), was_started(folder))
    except PermissionError:
        return CacheState(folder, 0, False, readable=False)


def mark_started(folder: Path) -> None:
    """A start of the recipe succeeded with this folder (where it exists: a start that could
    not use it kept nothing there)."""
    if (folder / STAMP).is_file() and not folder.is_symlink():  # the guard could use it
        with contextlib.suppress(OSError):
            (folder / STARTED).touch()


def was_started(folder: Path) -> bool:
    return (folder / STARTED).is_file()


# --- after a start ---------------------------------------------------------------------------


def judge_start(text: str, facts: EngineFacts, compiles: bool = True) -> StartCache | None:
    """Whether a start was cold or warm, and why, from its journal: the guard's line says what
    the folder held; the engine's own lines know better where they speak (a cache vLLM could not
    load is cold however full its folder), and give its times. `compiles`: whether the recipe
    compiles anything at all (appliance.engines.EngineFacts.compiles). None where nothing was
    said."""
    guard = [line for line in text.splitlines() if LINE in line]
    said = guard[-1].split(LINE, 1)[1].strip() if guard else ""
    verdict, _, detail = said.partition(": ")
    engine = facts.read_start(text)
    init_s = engine.init_s if engine else None
    compile_s = engine.compile_s if engine else None
    if verdict == "cold" and "keeps nothing" in detail:
        cause = "the cache " + detail.split(" ", 1)[1].split(";")[0]
        return StartCache("cold", cause, init_s, compile_s, (said,))
    if engine is not None and engine.verdict in ("warm", "cold"):
        return engine
    if not compiles or verdict == "none":
        return StartCache("none", "", init_s, compile_s, (said,)) if said or engine else None
    if verdict == "warm":
        return StartCache("warm", "", init_s, compile_s, (said,))
    if verdict == "cold":
        return StartCache("cold", "nothing kept yet", init_s, compile_s, (said,))
    return engine


def start_note(runtime: str, start: Mapping[str, Any]) -> str:
    """One line of what a start found in its lasting cache (a switch record's `start`), as the
    switch and `status` print it."""
    timed = []
    if start.get("init_s") is not None:
        timed.append(f"init engine {start['init_s']:g} s")
    if start.get("compile_s") is not None:
        timed.append(f"compilation {start['compile_s']:g} s")
    took = f" ({', '.join(timed)})" if timed else ""
    if start["verdict"] == "warm":
        return f"{runtime} started warm: it loaded what an earlier start compiled{took}"
    if start["verdict"] == "none":
        return f"{runtime} started; it compiles nothing here, so no cache to warm{took}"
    return f"{runtime} started cold: {start.get('cause') or 'nothing kept yet'}{took}"
