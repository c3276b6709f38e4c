"""Walking a parsed TOML file: typed values, tables, lists and choices, each error naming the
file and the dotted key. appliance.config.reader walks the appliance's sections with it."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from appliance.errors import ConfigError

T = TypeVar("T")


class Walker:
    """Walks parsed TOML; every error carries the file and the dotted key."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.models_dir = ""  # [models] dir, once read

    def fail(self, key: str, what: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{self.path}: {key}: {what}", hint=hint)

    def table(self, data: Mapping[str, Any], key: str, prefix: str = "") -> Mapping[str, Any]:
        value = data.get(key, {})
        if not isinstance(value, dict):
            raise self.fail(prefix + key, f"must be a table, not {kind_of(value)}")
        return value

    def known(self, data: Mapping[str, Any], prefix: str, allowed: set[str]) -> None:
        for key in data:
            if key not in allowed:
                raise self.fail(
                    prefix + key,
                    "unknown key",
                    hint="known keys here: " + ", ".join(sorted(allowed)),
                )

    def get(
        self,
        data: Mapping[str, Any],
        key: str,
        prefix: str,
        kind: type[T],
        default: T | None = None,
        check: Callable[[T], str | None] | None = None,
    ) -> T:
        full = prefix + key
        if key not in data:
            if default is None:
                raise self.fail(full, "missing", hint=f"add {key} = ... to the file")
            return default
        value = data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(full, f"must be {_article(kind)}, not {kind_of(value)} ({value!r})")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(full, f"{value} is not a finite number")
        if check is not None:
            problem = check(value)
            if problem:
                raise self.fail(full, problem)
        return value

    def strings(self, data: Mapping[str, Any], key: str, prefix: str) -> tuple[str, ...]:
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(prefix + key, f"must be a list of strings, not {value!r}")
        return tuple(value)

    def paths(
        self, data: Mapping[str, Any], key: str, prefix: str, example: str
    ) -> tuple[str, ...]:
        """A list of absolute paths, each optionally followed by ':' and more (container maps)."""
        values = self.strings(data, key, prefix)
        for i, value in enumerate(values):
            if not value.startswith("/"):
                raise self.fail(
                    f"{prefix}{key}[{i}]",
                    f"{value!r} must start with an absolute path",
                    f"e.g. {example}",
                )
        return values

    def path_value(self, data: Mapping[str, Any], key: str, prefix: str, default: str) -> str:
        value = os.path.expanduser(self.get(data, key, prefix, str, default))
        if not os.path.isabs(value):
            raise self.fail(prefix + key, f"{value!r} must be an absolute path")
        return value

    def choice(
        self, t: Mapping[str, Any], key: str, prefix: str, enum: type[StrEnum], default: Any
    ) -> Any:
        value = self.get(t, key, prefix, str, default.value if default else None)
        try:
            return enum(value)
        except ValueError:
            options = ", ".join(e.value for e in enum)
            raise self.fail(prefix + key, f"{value!r} is not one of: {options}") from None


def kind_of(value: object) -> str:
    return {dict: "a table", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _article(kind: type) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(kind, kind.__name__)
