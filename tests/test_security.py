"""Least privilege, measured: `systemd-analyze security --offline=true` on the rendered units.

The B70 config (system scope) is held to the figures of issue 10: the proxy at most 2.0, native
runtimes at most 3.5 with GPU access only, the monitor at most 5.0; container runtimes at the
figure reached, as a regression bound. The demo config (user scope) is held to the same figures,
and carries every hardening directive of the system units that is not about identity.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance import config
from appliance.layout import UNIT_SUFFIXES, Scope, layout
from appliance.units.render import render_all
from tests.conftest import REPO
from tests.test_render import analyze_verify, unit_lines, verify_root

B70 = REPO / "examples" / "b70.toml"
DEMO = REPO / "examples" / "demo.toml"

# Exposure at most, per unit and scope (the container figure is what this sandbox reaches).
LIMITS = {
    Scope.SYSTEM: {
        "b70-litellm.service": 2.0,
        "b70-llamacpp.service": 3.5,  # native
        "b70-monitor.service": 5.0,
        "b70-vllm.service": 2.5,  # docker
    },
    Scope.USER: {
        "b70-litellm.service": 2.0,
        "b70-llamacpp.service": 3.5,  # native
        "b70-vllm.service": 3.5,  # native
        "b70-monitor.service": 5.0,
    },
}
IDENTITY = {"User", "Group", "SupplementaryGroups", "AmbientCapabilities", "DynamicUser"}
# Where a unit may write and what it reads from /tmp: paths, which differ by scope.
FILE_KEYS = {"ProtectHome", "StateDirectory", "ReadWritePaths", "BindPaths", "BindReadOnlyPaths"}
SANDBOX_KEYS = {
    "CapabilityBoundingSet",
    "NoNewPrivileges",
    "ProtectSystem",
    "PrivateTmp",
    "PrivateMounts",
    "PrivateDevices",
    "PrivateUsers",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectClock",
    "ProtectHostname",
    "ProtectProc",
    "ProcSubset",
    "RestrictNamespaces",
    "RestrictRealtime",
    "RestrictSUIDSGID",
    "RestrictAddressFamilies",
    "LockPersonality",
    "MemoryDenyWriteExecute",
    "RemoveIPC",
    "KeyringMode",
    "SystemCallArchitectures",
    "SystemCallFilter",
    "SystemCallErrorNumber",
    "DevicePolicy",
    "DeviceAllow",
    "UMask",
    "IPAddressDeny",
    "IPAddressAllow",
    "CacheDirectory",
}


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if not found:
        pytest.fail(
            "systemd-analyze is not installed: these figures cannot be measured (install systemd)"
        )
    return found


def rendered(path: Path, scope: Scope) -> dict[str, str]:
    return render_all(config.load(path), layout(scope))


@pytest.fixture(scope="module")
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`systemd-analyze --user` wants a runtime directory; none is running here."""
    path = tmp_path_factory.mktemp("xdg-runtime")
    path.chmod(0o700)
    return path


def report(unit_file: Path, scope: Scope, runtime_dir: Path) -> str:
    argv = [systemd_analyze(), "security", "--offline=true", "--no-pager"]
    if scope is Scope.USER:
        argv.insert(1, "--user")
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime_dir))
    out = subprocess.run([*argv, str(unit_file)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def exposure(text: str) -> float:
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", text)
    assert found, text
    return float(found.group(1))


def sandbox(text: str) -> set[str]:
    """The hardening lines of a unit, as `Key=value`."""
    return {line for line in text.splitlines() if line.split("=", 1)[0] in SANDBOX_KEYS}


@pytest.mark.parametrize(("path", "scope"), [(B70, Scope.SYSTEM), (DEMO, Scope.USER)])
def test_exposure_is_within_the_limits(
    path: Path, scope: Scope, tmp_path: Path, runtime_dir: Path
) -> None:
    files = rendered(path, scope)
    units = sorted(n for n in files if n.endswith(".service"))
    assert units == sorted(LIMITS[scope]), "a unit without a limit: add it to LIMITS"
    scores = {}
    for name in units:
        (tmp_path / name).write_text(files[name])
        scores[name] = exposure(report(tmp_path / name, scope, runtime_dir))
    over = {n: (s, LIMITS[scope][n]) for n, s in scores.items() if s > LIMITS[scope][n]}
    assert not over, f"exposure above the limit (score, limit): {over}"


def test_a_native_runtime_gets_the_gpu_and_nothing_else(tmp_path: Path, runtime_dir: Path) -> None:
    llama = rendered(B70, Scope.SYSTEM)["b70-llamacpp.service"]
    assert unit_lines(llama, "User") == ["b70"]
    assert unit_lines(llama, "DevicePolicy") == ["closed"]
    assert unit_lines(llama, "DeviceAllow") == ["char-drm rw"]
    assert unit_lines(llama, "SupplementaryGroups") == ["render"]
    assert unit_lines(llama, "AmbientCapabilities") == ["CAP_PERFMON"]
    assert unit_lines(llama, "CapabilityBoundingSet") == ["CAP_PERFMON"]
    # systemd adds devices of its own for some settings (ProtectClock= adds /dev/rtc): read the
    # device list the way systemd sees it.
    (tmp_path / "b70-llamacpp.service").write_text(llama)
    text = report(tmp_path / "b70-llamacpp.service", Scope.SYSTEM, runtime_dir)
    row = next(line for line in text.splitlines() if "DeviceAllow=" in line)
    assert row.split("special devices:", 1)[1].split() == ["char-drm:rw", "0.1"], row


def test_the_proxy_has_its_own_user_no_capabilities_and_writes_only_its_folder() -> None:
    files = rendered(B70, Scope.SYSTEM)
    proxy = files["b70-litellm.service"]
    assert unit_lines(proxy, "User") == ["b70-proxy"]
    assert unit_lines(proxy, "CapabilityBoundingSet") == [""]
    assert unit_lines(proxy, "AmbientCapabilities") == []
    assert unit_lines(proxy, "ProtectSystem") == ["strict"]
    assert unit_lines(proxy, "ProtectHome") == ["yes"]
    assert unit_lines(proxy, "PrivateDevices") == ["yes"]
    # Writable: its folder in the state directory (the held-request counts) and its cache.
    assert unit_lines(proxy, "StateDirectory") == ["b70/held"]
    assert unit_lines(proxy, "CacheDirectory") == ["b70-litellm"]
    for key in ("ReadWritePaths", "BindPaths", "RuntimeDirectory", "LogsDirectory"):
        assert unit_lines(proxy, key) == [], key
    assert 'u b70-proxy - "b70 appliance proxy"' in files["b70-sysusers.conf"]


def test_the_monitor_is_root_with_exactly_what_it_needs() -> None:
    mon = rendered(B70, Scope.SYSTEM)["b70-monitor.service"]
    assert unit_lines(mon, "User") == []
    caps = unit_lines(mon, "CapabilityBoundingSet")
    assert caps == ["CAP_SYS_PTRACE CAP_DAC_READ_SEARCH CAP_PERFMON"]
    assert unit_lines(mon, "ProtectSystem") == ["strict"]
    assert unit_lines(mon, "StateDirectory") == ["b70"]
    assert unit_lines(mon, "RestrictAddressFamilies") == ["AF_UNIX AF_INET AF_INET6"]
    assert unit_lines(mon, "IPAddressDeny") == ["any"]


def test_the_demo_carries_every_hardening_directive_but_identity() -> None:
    system = rendered(B70, Scope.SYSTEM)
    user = rendered(DEMO, Scope.USER)
    pairs = [
        ("b70-litellm.service", "b70-litellm.service"),
        ("b70-monitor.service", "b70-monitor.service"),
        ("b70-llamacpp.service", "b70-llamacpp.service"),  # native, both
        ("b70-llamacpp.service", "b70-vllm.service"),  # native in the demo
    ]
    for system_unit, user_unit in pairs:
        ours = {
            line
            for line in sandbox(system[system_unit])
            if line.split("=", 1)[0] not in FILE_KEYS
            and not line.startswith(("IPAddress", "CacheDirectory="))
        }
        missing = ours - sandbox(user[user_unit])
        assert not missing, (user_unit, missing)
    for name, text in user.items():
        for key in IDENTITY:
            assert unit_lines(text, key) == [], (name, key)


def test_paths_under_tmp_are_bound_into_the_private_tmp(tmp_path: Path) -> None:
    """A config or model kept in /tmp stays visible behind PrivateTmp=, whatever its name."""
    odd = Path("/tmp") / 'b70 odd %dir "q" \\b' / "m.gguf"
    model = '"/srv/b70/models/Qwen3.6-35B-A3B-Q4_K_M.gguf"'
    text = B70.read_text().replace(model, json.dumps(str(odd)))
    files = render_all(config.parse(text, B70), layout(Scope.SYSTEM))
    llama = files["b70-llamacpp.service"]
    assert unit_lines(llama, "PrivateTmp") == ["yes"]
    assert unit_lines(llama, "BindReadOnlyPaths") == ['"-/tmp/b70 odd %%dir \\"q\\" \\\\b"']
    units = [n for n in files if n.endswith(UNIT_SUFFIXES)]
    assert analyze_verify(verify_root(tmp_path, files), units) == ""
