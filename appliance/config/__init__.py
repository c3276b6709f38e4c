"""The appliance configuration: one TOML file, read into frozen dataclasses and checked whole.

model.py holds the dataclasses, values.py the checks of single values, reader.py the reading.

May import: the core modules alone (appliance.errors, layout, sizes): every room reads the config.
"""

from appliance.config.model import (
    DEFAULT_COMMAND,
    DEFAULT_START_TIMEOUT_S,
    RESERVED_FLAGS,
    SYSTEM_CONFIG,
    BackendConfig,
    Config,
    Engine,
    GpuConfig,
    Launcher,
    MonitorConfig,
    PeersConfig,
    ProxyConfig,
    RuntimeConfig,
    SwitchingConfig,
    default_b70ctl,
    default_config_path,
)
from appliance.config.reader import load, parse
from appliance.config.values import LOOPBACK_NAMES, hosts_overlap, is_loopback
from appliance.layout import Scope

__all__ = [
    "DEFAULT_COMMAND",
    "DEFAULT_START_TIMEOUT_S",
    "LOOPBACK_NAMES",
    "RESERVED_FLAGS",
    "SYSTEM_CONFIG",
    "BackendConfig",
    "Config",
    "Engine",
    "GpuConfig",
    "Launcher",
    "MonitorConfig",
    "PeersConfig",
    "ProxyConfig",
    "RuntimeConfig",
    "Scope",
    "SwitchingConfig",
    "default_b70ctl",
    "default_config_path",
    "hosts_overlap",
    "is_loopback",
    "load",
    "parse",
]
