"""The one exception type the controller raises for anything a user should read."""

from __future__ import annotations


class ApplianceError(Exception):
    """A failure with a message (what failed), a hint (what to do next) and a stable code.

    The CLI prints message and hint on stderr (or inside the --json envelope) and exits with
    `exit_code`. Tracebacks are shown only with --debug.
    """

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        code: str = "error",
        exit_code: int = 1,
        details: dict[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = code
        self.exit_code = exit_code
        self.details = details or {}


class ConfigError(ApplianceError):
    """A configuration file is missing, unreadable or invalid."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, code="config_invalid", exit_code=2)
