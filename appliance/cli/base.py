"""The command line's frame: the context every command gets, --json, the one error path, and
the console script (`main`). The commands are in the modules beside this one."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from appliance import config as config_mod
from appliance.cli import output
from appliance.config import Config
from appliance.errors import ApplianceError, from_exception
from appliance.layout import Scope


@dataclasses.dataclass
class Context:
    """What every command gets: the config's path, the scope, --debug and --json."""

    config_path: Path | None
    scope: Scope
    debug: bool
    json: bool = False

    def config(self) -> Config:
        return config_mod.load(self.config_path or config_mod.default_config_path(self.scope))

    def require_root(self, command: str) -> None:
        """A command that changes the system's units or the appliance's files is root's (who may
        do what: docs/security.md). Anyone may run the commands that only read."""
        if self.scope is Scope.SYSTEM and os.geteuid() != 0:
            raise ApplianceError(
                f"`b70ctl {command}` changes the appliance: only root may run it "
                "(status, gpu, logs, plan, doctor and bench only read, and work for anyone)",
                hint=f"run it as root: `sudo b70ctl {command} ...`; an admin can let a group "
                'switch with one sudoers line (docs/security.md, "Who may do what")',
                code="not_permitted",
            )


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


def with_json(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adds --json and records it on the context, so errors are printed as JSON too."""

    @json_option
    @click.pass_obj
    def wrapper(ctx: Context, /, as_json: bool, **kwargs: Any) -> Any:
        ctx.json = as_json
        return fn(ctx, **kwargs)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class ApplianceGroup(click.Group):
    """The one error path, for every command: message and hint, or the JSON envelope.

    Any exception a command lets escape (the appliance's own, OSError, decoding, D-Bus, a
    subprocess timeout, Ctrl-C) ends here; click's own exceptions (usage errors, exit) go on to
    `main`. A traceback is printed only with --debug.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except BrokenPipeError:
            # The reader left (`b70ctl status | head -3`): nothing to tell it. stdout goes to
            # /dev/null, so that flushing it at exit does not fail again; exit as SIGPIPE would.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(128 + signal.SIGPIPE)
        except (Exception, KeyboardInterrupt) as exc:
            obj = ctx.obj
            if obj is not None and obj.debug:
                raise
            error = from_exception(exc)
            if obj is not None and obj.json:
                output.emit_json_error(error)
            else:
                output.emit_error(error)
            ctx.exit(error.exit_code)


@click.group(
    cls=ApplianceGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    envvar="B70_CONFIG",
    help="The appliance config (default /etc/b70/appliance.toml; with --user "
    "~/.config/b70/appliance.toml). Env: B70_CONFIG.",
)
@click.option(
    "--user",
    "user_scope",
    is_flag=True,
    envvar="B70_USER",
    help="Use the user's systemd manager instead of the system one. Env: B70_USER=1.",
)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.version_option(package_name="b70-appliance")
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None, user_scope: bool, debug: bool) -> None:
    """Run vLLM and llama.cpp on an Intel Arc Pro B70 under systemd, behind one proxy on :8000.

    \b
    Example:
      b70ctl install && b70ctl switch llamacpp && b70ctl status
    """
    ctx.obj = Context(config_path, Scope.USER if user_scope else Scope.SYSTEM, debug)


def guard_log(message: str) -> None:
    """A line of a unit's guard (`unit pre`, `gpu wait-free`): stderr, the unit's journal."""
    output.log(message)


def main(argv: list[str] | None = None) -> None:
    """The console script: click's usage errors, too, become the JSON envelope with --json.
    `argv`: the arguments, when not those of the process (the tests call it in-process)."""
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    try:
        code = cli.main(args=args, standalone_mode=False)
    except click.exceptions.Abort:  # Ctrl-C while click itself was prompting or parsing
        code = _fail(ApplianceError("interrupted", code="interrupted", exit_code=130), as_json)
    except click.ClickException as e:
        if as_json:
            error = ApplianceError(
                e.format_message(),
                hint="see b70ctl COMMAND --help",
                code="usage_error",
                exit_code=e.exit_code,
            )
            code = _fail(error, as_json)
        else:
            e.show()
            code = e.exit_code
    code = code if isinstance(code, int) else 0
    if argv is None:  # the console script, not a test calling in-process
        exit_at_once(code)
    sys.exit(code)


def exit_at_once(code: int) -> None:
    """Flush what was written and end the process without tearing the interpreter down:
    freeing every module's objects one by one would only delay the exit. The `with` blocks
    that opened files, locks, sockets and the bus have closed them by now, and nothing
    registers an atexit handler."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # the reader left, or it is closed
            stream.flush()
    os._exit(code)


def _fail(error: ApplianceError, as_json: bool) -> int:
    if as_json:
        output.emit_json_error(error)
    else:
        output.emit_error(error)
    return error.exit_code
