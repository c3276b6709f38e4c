"""The shape of what an engine module answers (appliance.engines.vllm, .llamacpp)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheVariable:
    """A variable by which an engine, or a library under it, is told where to keep what it
    compiles, or that it may keep it at all.

    `folder`: its folder inside the recipe's cache folder; None for a switch, whose `value` turns
    the lasting cache on. `source`: where the variable is documented, for docs/startup.md.
    """

    name: str
    folder: str | None = None
    value: str = ""
    source: str = ""


@dataclass(frozen=True)
class StartCache:
    """What one start's own lines say of its compile cache.

    verdict: "warm" (it loaded what an earlier start compiled), "cold" (it compiled), "none"
    (it compiles nothing: vLLM with --enforce-eager), or "" (the engine did not say). cause:
    why a start was cold, in the engine's words where it gave them. init_s, compile_s: vLLM's
    "init engine ... took X s (compilation: Y s)", where it printed them.
    """

    verdict: str
    cause: str = ""
    init_s: float | None = None
    compile_s: float | None = None
    lines: tuple[str, ...] = ()


def no_lines(text: str) -> StartCache | None:
    """An engine that says nothing of its caches at start-up."""
    return None


def always(args: Sequence[str]) -> bool:
    """An engine that compiles at every start where it runs on the card (SYCL's JIT)."""
    return True


@dataclass(frozen=True)
class EngineFacts:
    """One engine, as the rest of the appliance asks about it.

    caches: every variable the appliance points at the runtime's lasting cache.
    cold_env: what a start that must keep nothing sets besides (the folder cannot be written).
    warm_globs: inside the recipe's folder, what only a start that compiled leaves behind.
    read_start: its start-up lines (a journal's text) to what they say of the cache; None where
    they say nothing.
    compiles: whether a start with these arguments compiles anything at all.
    """

    name: str
    caches: tuple[CacheVariable, ...]
    cold_env: Mapping[str, str] = field(default_factory=dict)
    warm_globs: tuple[str, ...] = ()
    read_start: Callable[[str], StartCache | None] = no_lines
    compiles: Callable[[Sequence[str]], bool] = always

    @property
    def folders(self) -> dict[str, str]:
        """The cache variables that name a folder: variable -> its folder in the recipe's."""
        return {v.name: v.folder for v in self.caches if v.folder}
