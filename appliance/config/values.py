"""The checks of single config values: numbers in range, names, hosts, words for a command
line. Each returns what is wrong with a value, or None; `refuse_control_characters` raises."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from appliance.errors import ConfigError

# A runtime name becomes a unit name (b70-NAME.service), a container name and a journal tag.
NAME_RE = re.compile(r"^[a-z](?:[a-z0-9]|-(?=[a-z0-9])){0,31}$")
# Names the appliance uses for its own units and files (b70-litellm.service, ...): a runtime
# named so would replace them, and `b70ctl logs proxy` names the proxy.
RESERVED_NAMES = frozenset({"litellm", "proxy", "monitor", "sysusers", "status", "socket"})
# C0 control characters and DEL: a newline in a value would start a new line in a unit file.
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
# systemd reads these as prefixes of an Exec*= executable ("-" ignores failure, "+" runs it with
# full privileges): a command never starts with one.
EXEC_PREFIX_CHARS = "-@+!:|"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def check_port(value: int) -> str | None:
    return None if 1 <= value <= 65535 else f"{value} is not a TCP port (1-65535)"


HOUR_S = 3600
DAY_S = 86400
MAX_MEMORY_GIB = 1024
MAX_CACHE_GIB = 4096  # a runtime's lasting cache (appliance.engines.lasting)


def check_range(low: float, high: float, low_open: bool = False) -> Callable[[float], str | None]:
    """A check that a number lies in [low, high], or (low, high] with low_open."""

    def check(value: float) -> str | None:
        if value < low or (low_open and value == low):
            if low == 0:
                return (
                    f"{value} must be greater than 0"
                    if low_open
                    else (f"{value} must not be negative")
                )
            return f"{value} must be at least {low:g}"
        if value > high:
            return f"{value} must be at most {high:g}"
        return None

    return check


def check_word(value: str) -> str | None:
    """A value that follows a flag: not empty, and not itself read as a flag."""
    if not value.strip():
        return "must not be empty"
    if value.startswith("-"):
        return f"{value!r} starts with '-', so the runtime would read it as a flag"
    return None


def check_executable(value: str) -> str | None:
    if value.startswith("/") or re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", value):
        return None
    if value[:1] in EXEC_PREFIX_CHARS:
        return f"{value!r} starts with {value[0]!r}, which systemd reads as a prefix"
    return f"{value!r} must be an absolute path or a bare command name"


def check_image(value: str) -> str | None:
    if re.fullmatch(r"[a-z0-9][A-Za-z0-9._/:@-]*", value):
        return None
    return f"{value!r} is not a container image reference such as registry/name:tag"


def check_size(value: str) -> str | None:
    if re.fullmatch(r"[0-9]+[bkmgBKMG]?", value):
        return None
    return f"{value!r} is not a size such as 8g"


_HOSTNAME_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(?:\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*")


def check_host(value: str) -> str | None:
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    if len(value) <= 253 and _HOSTNAME_RE.fullmatch(value):
        return None
    if value.startswith("[") or value.count(":") == 1:
        return (
            f"{value!r} is not a host name or IP address: give the port as port = N, "
            "and an IPv6 address without brackets"
        )
    return f"{value!r} is not a host name or IP address"


def check_listen_host(value: str) -> str | None:
    """The proxy's address: systemd binds it (ListenStream=), and takes no host names there."""
    if (problem := check_host(value)) or value.lower() in LOOPBACK_NAMES:
        return problem
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return (
            f"{value!r} is a host name; the proxy listens on an IP address: "
            "0.0.0.0 (or ::) for every interface, or the address of one"
        )
    return None


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _address_key(host: str) -> str:
    """What a listener's host binds: '*' for every address, one key for all of loopback."""
    if host in WILDCARD_HOSTS:
        return "*"
    if is_loopback(host):
        return "loopback"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    return "*" if ip.is_unspecified else str(ip)


def hosts_overlap(a: str, b: str) -> bool:
    """Whether listeners on these two hosts and one port would clash."""
    key_a, key_b = _address_key(a), _address_key(b)
    return "*" in (key_a, key_b) or key_a == key_b


def check_model_name(value: str) -> str | None:
    if MODEL_NAME_RE.fullmatch(value):
        return None
    return f"{value!r} is not a model name (letters, digits and . _ : / -)"


def check_user_name(value: str) -> str | None:
    if re.fullmatch(r"[a-z_][a-z0-9_-]{0,30}", value) and value != "root":
        return None
    return f"{value!r} is not a system user name (a-z, 0-9, _ and -; not root)"


def check_pci_address(value: str) -> str | None:
    if value == "auto" or re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", value):
        return None
    return f"{value!r} is neither 'auto' nor a PCI address such as 0000:03:00.0"


def check_peer_url(value: str) -> str | None:
    """A peer appliance's proxy: http://HOST:PORT or https://HOST:PORT (a peer with [proxy] tls),
    nothing after it (the proxy adds /v1)."""
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{value!r} is not an http:// or https://HOST:PORT address of a peer's proxy"
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return f"{value!r}: only http(s)://HOST:PORT, the peer's :8000 (the proxy adds /v1)"
    try:
        port = parts.port
    except ValueError:
        return f"{value!r} has a port that is not a number from 1 to 65535"
    if port is None:
        return f"{value!r} has no port: the peer's proxy port, usually 8000"
    return check_host(parts.hostname)


def refuse_control_characters(path: Path, data: object, key: str = "") -> None:
    """Every key and string of the file, at any depth, is free of control characters.

    Strings become unit-file lines and command-line words; one with a newline could add a line
    such as ExecStartPre=, a NUL would be written into the file. The error names the dotted key
    and, in a list, the index.
    """
    where = key or "(top level)"
    if isinstance(data, str):
        if match := CONTROL_RE.search(data):
            raise ConfigError(
                f"{path}: {where}: holds the control character {match.group()!r} at "
                f"position {match.start()}",
                hint="values may not hold newlines, tabs, NUL or other control characters",
            )
    elif isinstance(data, dict):
        for name, value in data.items():
            refuse_control_characters(path, name, key)
            refuse_control_characters(path, value, f"{key}.{name}" if key else name)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            refuse_control_characters(path, value, f"{where}[{i}]")
