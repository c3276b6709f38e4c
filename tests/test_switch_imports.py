"""What a switch imports: a b70ctl process starts for each switch, and every import is paid on
its path (docs/switch.md, "What the controller costs"). Each check runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True
    )


def test_a_switch_reaches_systemd_without_pystemds_object_layer() -> None:
    out = run(
        """
        import sys
        import appliance.cli, appliance.switch.apply
        from appliance.units import systemd
        systemd._import_bus_binding()
        from pystemd.dbuslib import DBus, DBusAddress, apply_signature
        from pystemd.dbusexc import DBusNoSuchUnitError
        heavy = {"lxml", "lxml.etree", "pystemd.base", "jinja2", "httpx", "psutil"}
        print(sorted(heavy & set(sys.modules)))
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_binding_that_needs_its_whole_package_gets_it() -> None:
    """Were pystemd's binding to need what its package __init__ sets up, pystemd is imported
    the usual way."""
    out = run(
        """
        import importlib, sys
        from appliance.units import systemd
        real = importlib.import_module
        def picky(name, *args):
            if name == "pystemd.dbuslib" and not hasattr(sys.modules["pystemd"], "systemd1"):
                raise ImportError("cannot import name 'DBus' from partially set-up pystemd")
            return real(name, *args)
        importlib.import_module = picky
        systemd._import_bus_binding()
        importlib.import_module = real
        print("pystemd" in sys.modules)
        import pystemd
        from pystemd.dbuslib import DBus
        print(hasattr(pystemd, "systemd1"))
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
