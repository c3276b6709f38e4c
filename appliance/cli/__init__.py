"""b70ctl: render, install and switch the appliance's systemd units.

One click group (appliance.cli.base), one short function per command, one error handler
(`main`). Importing this package registers every command. Also what the CLI prints (`output`)
and a switch's moving line on a terminal (`live`).

May import: every room but the proxy; commands import what they need inside their function, so
that `b70ctl status` does not load what `b70ctl switch` needs.
"""

from appliance.cli import machine, measuring, models, people, serving
from appliance.cli.base import cli, main

__all__ = ["cli", "machine", "main", "measuring", "models", "people", "serving"]
