"""One way to run another program: to its end, its output captured as text, stdin closed.

A program that is missing, cannot start or does not end in time becomes the appliance's error
(`run`), naming it, with a hint; or, where its answer is only a nicety, no answer (`ask`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence

from appliance.errors import ApplianceError

Completed = subprocess.CompletedProcess[str]


def _run(argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None) -> Completed:
    return subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(env) if env is not None else None,
        stdin=subprocess.DEVNULL,
    )


def run(
    argv: Sequence[str],
    timeout_s: float,
    hint: str,
    env: Mapping[str, str] | None = None,
    code: str = "command_failed",
) -> Completed:
    """The finished program, whatever its exit status; raises when it could not run or end."""
    try:
        return _run(argv, timeout_s, env)
    except FileNotFoundError:
        raise ApplianceError(f"{argv[0]} is not installed", hint=hint, code=code) from None
    except OSError as e:
        raise ApplianceError(
            f"cannot run {argv[0]}: {e.strerror or e}", hint=hint, code=code
        ) from None
    except subprocess.TimeoutExpired:
        raise ApplianceError(
            f"{' '.join(argv[:3])}: no answer within {timeout_s:g} s", hint=hint, code=code
        ) from None


def ask(
    argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None
) -> Completed | None:
    """The finished program, or None when it could not run or end: for answers that are only
    extra information (a journal excerpt, a container's pid)."""
    try:
        return _run(argv, timeout_s, env)
    except (OSError, subprocess.TimeoutExpired):
        return None
