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


def from_exception(error: BaseException) -> ApplianceError:
    """Any exception that escaped a command, as the appliance's error: what failed and a hint.

    The CLI's one error path calls this, so no input or environment ends in a traceback; the
    traceback itself is shown only with --debug.
    """
    import subprocess

    if isinstance(error, ApplianceError):
        return error
    if isinstance(error, KeyboardInterrupt):
        return ApplianceError("interrupted", code="interrupted", exit_code=130)
    if isinstance(error, subprocess.TimeoutExpired):
        command = error.cmd if isinstance(error.cmd, str) else " ".join(map(str, error.cmd))
        return ApplianceError(
            f"{command}: no answer within {error.timeout:g} s",
            hint="the command hung; check the system's load and the service it talks to",
            code="command_timeout",
        )
    if isinstance(error, UnicodeError):
        return ApplianceError(
            f"cannot decode text: {error}",
            hint="a file or a command's output is not UTF-8",
            code="decode_error",
        )
    if isinstance(error, OSError):
        import errno

        where = f"{error.filename}: " if error.filename is not None else ""
        also = f" ({error.filename2})" if error.filename2 is not None else ""
        hint = "check the path, its permissions and the free space there"
        if error.errno in (errno.ENOSPC, errno.EDQUOT) and error.filename is not None:
            hint = f"the file system is full: free space there (df -h {error.filename})"
        return ApplianceError(f"{where}{error.strerror or error}{also}", hint=hint, code="os_error")
    if type(error).__module__.startswith("pystemd"):
        return ApplianceError(
            f"systemd answered: {error}",
            hint="check that the systemd manager runs and that you may talk to it "
            "(root for the system manager, --user for your own)",
            code="systemd_error",
        )
    return ApplianceError(
        f"internal error: {type(error).__name__}: {error}",
        hint="this is a bug in b70ctl; run the command again with --debug and report the traceback",
        code="internal_error",
    )
