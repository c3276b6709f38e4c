"""b70ctl: render, install and switch the appliance's systemd units.

One click group (appliance.cli.base), one short function per command, one error handler
(`main`). Importing this package registers every command.
"""

from appliance.cli import machine, measuring, serving
from appliance.cli.base import cli, main

__all__ = ["cli", "machine", "main", "measuring", "serving"]
