"""Where an installation lives, and every name it gives to units, containers and files.

The one home of these names: a unit name is built or parsed nowhere else. The request hold's
files (hold.json, held/) are named in appliance/hold.py, because the proxy imports nothing
from the rest of the appliance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

PREFIX = "b70-"

# The appliance's own units.
PROXY_UNIT = "b70-litellm.service"
PROXY_SOCKET = "b70-litellm.socket"  # holds :8000 while the proxy restarts
MONITOR_UNIT = "b70-monitor.service"
UNIT_SUFFIXES = (".service", ".socket")  # the files that go to the unit directory

# Files in the config directory (/etc/b70, ~/.config/b70).
INSTALLED_CONFIG = "appliance.toml"
PROXY_CONFIG = "litellm.yaml"
KEY_FILE = "proxy.env"
SYSUSERS = "b70-sysusers.conf"  # installed as /etc/sysusers.d/b70.conf
SYSUSERS_PATH = Path("/etc/sysusers.d/b70.conf")

# Files in the state directory (/var/lib/b70, ~/.local/state/b70).
LOCK_FILE = "switch.lock"  # an flock only; it holds nothing
NOTE_FILE = "switch.json"  # the running switch: who, to what, how far
KILLED_FILE = "killed-switch.json"  # a killed switch's note, until it is recovered
LAST_SWITCH = "last-switch.json"
HISTORY = "switches.jsonl"
MONITOR_RECORD = "monitor.json"  # the monitor's record: its counters, what it last saw and did
SAMPLES = "samples.jsonl"  # the monitor's last hour (appliance.watch.samples)
CANARY_FILE = "canaries.json"
# What install last wrote, and from what (appliance.units.rendered.stamp).
RENDERED = "rendered.json"


class Scope(StrEnum):
    SYSTEM = "system"
    USER = "user"


def runtime_unit(name: str) -> str:
    """The unit of runtime `name`: b70-NAME.service."""
    return f"{PREFIX}{name}.service"


def runtime_of(unit: str) -> str | None:
    """The runtime whose unit this is, or None for a unit that is no runtime's."""
    if not (unit.startswith(PREFIX) and unit.endswith(".service")):
        return None
    if unit in (PROXY_UNIT, MONITOR_UNIT):
        return None
    return unit.removeprefix(PREFIX).removesuffix(".service") or None


def container_name(name: str) -> str:
    """The container of runtime `name` (docker and podman)."""
    return f"{PREFIX}{name}"


def cache_name(unit: str) -> str:
    """A unit's CacheDirectory= name: the unit's name without its suffix."""
    return unit.removesuffix(".service")


@dataclass(frozen=True)
class Layout:
    """Where an installation lives, by scope."""

    scope: Scope
    unit_dir: Path
    etc_dir: Path
    state_dir: Path

    @property
    def key_file(self) -> Path:
        return self.etc_dir / KEY_FILE

    @property
    def proxy_config(self) -> Path:
        return self.etc_dir / PROXY_CONFIG

    @property
    def config(self) -> Path:
        """Where install keeps the config the units were rendered from."""
        return self.etc_dir / INSTALLED_CONFIG

    @property
    def cache_root(self) -> Path:
        """Where each unit's CacheDirectory= is (systemd's %C)."""
        if self.scope is Scope.SYSTEM:
            return Path("/var/cache")
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")

    @property
    def wanted_by(self) -> str:
        return "multi-user.target" if self.scope is Scope.SYSTEM else "default.target"

    def destination(self, file_name: str) -> Path:
        if file_name == SYSUSERS:
            return SYSUSERS_PATH
        return (self.unit_dir if file_name.endswith(UNIT_SUFFIXES) else self.etc_dir) / file_name


def layout(scope: Scope) -> Layout:
    if scope is Scope.SYSTEM:
        return Layout(scope, Path("/etc/systemd/system"), Path("/etc/b70"), Path("/var/lib/b70"))
    home = Path.home()
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    state_home = Path(os.environ.get("XDG_STATE_HOME") or home / ".local" / "state")
    return Layout(scope, config_home / "systemd" / "user", config_home / "b70", state_home / "b70")
