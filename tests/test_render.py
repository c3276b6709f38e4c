"""Rendering: the reference units, systemd-analyze verify, the After= rule and quoting."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance import config
from appliance.layout import UNIT_SUFFIXES, Scope, layout
from appliance.units import runtimes
from appliance.units.render import quote_exec_arg, render_all, render_exec
from tests.conftest import REPO

B70 = REPO / "examples" / "b70.toml"
STUB_EXECUTABLES = [
    "opt/b70/bin/b70ctl",
    "opt/b70/bin/b70-proxy",
    "opt/llama.cpp/bin/llama-server",
    "usr/bin/docker",
]


def rendered_b70() -> dict[str, str]:
    # Rendered the way the README says: from the repository root, with a relative --config.
    return render_all(config.load(B70.relative_to(Path.cwd())), layout(Scope.SYSTEM))


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def test_reference_units_are_what_render_makes() -> None:
    files = rendered_b70()
    on_disk = {p.name: p.read_text() for p in (REPO / "units").iterdir()}
    assert on_disk == files, "units/ is stale: b70ctl --config examples/b70.toml render --out units"


def verify_root(tmp_path: Path, files: dict[str, str]) -> Path:
    """A root tree with the stock units, our units and stub executables (none exist on CI)."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for name, text in files.items():
        if name.endswith(UNIT_SUFFIXES):
            (root / "etc/systemd/system" / name).write_text(text)
    for exe in STUB_EXECUTABLES:
        path = root / exe
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return root


def analyze_verify(root: Path, units: list[str]) -> str:
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"--root={root}", *units],
        capture_output=True,
        text=True,
    )
    return out.stdout + out.stderr


def test_reference_units_pass_systemd_analyze_verify_silently(tmp_path: Path) -> None:
    files = rendered_b70()
    units = [n for n in files if n.endswith(UNIT_SUFFIXES)]
    assert analyze_verify(verify_root(tmp_path, files), units) == ""


def test_verify_does_speak_up_on_a_bad_unit(tmp_path: Path) -> None:
    files = rendered_b70()
    files["b70-vllm.service"] = files["b70-vllm.service"].replace(
        "Restart=on-failure", "Restart=sometimes"
    )
    output = analyze_verify(verify_root(tmp_path, files), ["b70-vllm.service"])
    assert "b70-vllm.service:" in output and "sometimes" in output


THREE = """
default_runtime = "a"
b70ctl = "/opt/b70/bin/b70ctl"
[runtimes.a]
engine = "llamacpp"
model = "/m.gguf"
[runtimes.c]
engine = "vllm"
model = "/m"
[runtimes.b]
engine = "vllm"
launcher = "podman"
image = "localhost/vllm:1"
model = "/m"
"""


def unit_lines(text: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def test_every_pair_conflicts_and_exactly_one_side_orders_after_the_other() -> None:
    cfg = config.parse(THREE, Path("three.toml"))
    files = render_all(cfg, layout(Scope.SYSTEM))
    units = ["b70-a.service", "b70-b.service", "b70-c.service"]
    for x, y in itertools.combinations(units, 2):
        assert y in unit_lines(files[x], "Conflicts") and x in unit_lines(files[y], "Conflicts")
        after = (y in unit_lines(files[x], "After")) + (x in unit_lines(files[y], "After"))
        assert after == 1, (x, y)
    for unit in units:
        text = files[unit]
        assert unit_lines(text, "Type") == ["exec"]
        assert unit_lines(text, "ExecStartPost")[0].startswith("/opt/b70/bin/b70ctl unit ready ")
        assert "${MAINPID}" in unit_lines(text, "ExecStartPost")[0]
    podman = files["b70-b.service"]
    assert unit_lines(podman, "ExecStopPost") == ["/usr/bin/podman rm --force b70-b"]
    assert unit_lines(podman, "ExecStartPre")[0] == "-/usr/bin/podman rm --force b70-b"


def test_the_port_guard_binds_where_the_runtime_will() -> None:
    """The guard tries the runtime's own address: a connection's local end on it holds the port
    though nothing listens there. The default address is the guard's default, left unsaid."""
    guard = unit_lines(
        render_all(config.parse(THREE, Path("t.toml")), layout(Scope.SYSTEM))["b70-a.service"],
        "ExecStartPre",
    )
    assert "--host" not in guard[-1]
    v6 = config.parse(THREE + '[backend]\nhost = "::1"\n', Path("t.toml"))
    guard = unit_lines(render_all(v6, layout(Scope.SYSTEM))["b70-a.service"], "ExecStartPre")
    assert guard[-1].startswith("/opt/b70/bin/b70ctl unit pre --port 8001 --host ::1 --device ")


@pytest.mark.parametrize("launcher", ["docker", "podman"])
def test_container_options_come_after_the_appliances_own_and_before_the_image(
    launcher: str, tmp_path: Path
) -> None:
    """`container_options` reach `docker run` / `podman run` word for word, quoted for systemd,
    between the appliance's own options and the image; the engine's arguments follow the image."""
    options = ["--runtime", "runc", "--ulimit", "nofile=1024:1024", "--label", "note=100% sure"]
    text = THREE.replace('launcher = "podman"', f'launcher = "{launcher}"').replace(
        'image = "localhost/vllm:1"',
        'image = "localhost/vllm:1"\nvolumes = ["/srv/m:/m:ro"]\ncontainer_options = '
        + json.dumps(options),
    )
    cfg = config.parse(text, Path("t.toml"))
    argv = runtimes.exec_start(cfg, cfg.runtimes["b"])
    image = argv.index("localhost/vllm:1")
    assert argv[image - len(options) : image] == options
    # the owner's volumes, then the runtime's lasting cache, then its environment
    volumes = [argv[i + 1] for i, a in enumerate(argv[:image]) if a == "--volume"]
    assert volumes == ["/srv/m:/m:ro", "%C/b70-b:/b70-cache"]
    assert argv[image - len(options) - 2] == "--env"
    assert argv[image + 1 : image + 3] == ["--model", "/m"]
    files = render_all(cfg, layout(Scope.SYSTEM))
    start = unit_lines(files["b70-b.service"], "ExecStart")
    assert start == [render_exec(argv)]
    assert '--label "note=100%% sure" localhost/vllm:1 --model /m ' in start[0]
    # Only the run takes them: the unit stops and removes the container by its name alone.
    assert unit_lines(files["b70-b.service"], "ExecStopPost") == [
        f"/usr/bin/{launcher} rm --force b70-b"
    ]
    assert "--ulimit" not in files["b70-a.service"] + files["b70-c.service"]
    root = verify_root(tmp_path, files)
    (root / "usr/bin/podman").write_text("#!/bin/sh\n")  # a stub, as for docker
    (root / "usr/bin/podman").chmod(0o755)
    assert analyze_verify(root, ["b70-b.service"]) == ""


@pytest.mark.parametrize(
    ("arg", "quoted"),
    [
        ("--port", "--port"),
        ("/a/b.gguf", "/a/b.gguf"),
        ("two words", '"two words"'),
        ('{"a":[1,2]}', '"{\\"a\\":[1,2]}"'),
        ("100%", '"100%%"'),
        ("$HOME", '"$$HOME"'),
        ("a\\.b", '"a\\\\.b"'),
        (";", '";"'),
        ("", '""'),
    ],
)
def test_exec_quoting(arg: str, quoted: str) -> None:
    assert quote_exec_arg(arg) == quoted


def test_render_exec_joins_words() -> None:
    assert render_exec(["/bin/x", "a b", "c"]) == '/bin/x "a b" c'


def test_a_runtime_user_gets_the_render_group_and_cap_perfmon_and_no_more() -> None:
    files = rendered_b70()
    llama = files["b70-llamacpp.service"]
    assert unit_lines(llama, "User") == ["b70"]
    assert unit_lines(llama, "SupplementaryGroups") == ["render"]
    assert unit_lines(llama, "AmbientCapabilities") == ["CAP_PERFMON"]
    assert unit_lines(llama, "CapabilityBoundingSet") == ["CAP_PERFMON"]
    assert "User=" not in files["b70-vllm.service"]  # the docker client stays as it is
    assert files["b70-sysusers.conf"].splitlines()[1:] == [
        'u b70-proxy - "b70 appliance proxy" /var/cache/b70-litellm -',
        'u b70 - "b70 appliance runtime" /var/lib/b70 -',
        "m b70 render",
    ]
    # A user manager cannot change users: nothing of it is rendered there.
    cfg = config.load(B70.relative_to(Path.cwd()))
    user_files = render_all(cfg, layout(Scope.USER))
    assert "b70-sysusers.conf" not in user_files
    assert "User=" not in user_files["b70-llamacpp.service"]


def exposure(root: Path, unit: str) -> float:
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", f"--root={root}", "--no-pager", unit],
        capture_output=True,
        text=True,
    )
    line = next(x for x in out.stdout.splitlines() if "Overall exposure level" in x)
    return float(line.split(":")[1].split()[0])


def test_the_run_as_unit_is_less_exposed(tmp_path: Path) -> None:
    files = rendered_b70()
    as_root = files["b70-llamacpp.service"]
    for key in (
        "User",
        "Group",
        "SupplementaryGroups",
        "AmbientCapabilities",
        "CapabilityBoundingSet",
        "NoNewPrivileges",
    ):
        as_root = "\n".join(x for x in as_root.splitlines() if not x.startswith(key + "="))
    files["b70-llamacpp-as-root.service"] = as_root + "\n"
    root = verify_root(tmp_path, files)
    assert exposure(root, "b70-llamacpp.service") < exposure(root, "b70-llamacpp-as-root.service")


def unit_value(text: str, key: str) -> str:
    values = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]
    assert len(values) == 1, (key, values)
    return values[0]


def flag_value(argv: str, flag: str) -> int:
    words = argv.split()
    return int(words[words.index(flag) + 1])


@pytest.mark.parametrize("launcher", ["native", "docker", "podman"])
def test_stop_timeouts_nest_unit_over_container_over_vllm(launcher: str) -> None:
    """vLLM finishes its requests within --shutdown-timeout; docker waits longer before it kills
    vLLM; systemd waits longer still before it kills docker's client and the container."""
    text = B70.read_text().replace('launcher = "docker"', f'launcher = "{launcher}"')
    if launcher == "native":
        text = text.replace('image = "ghcr.io/riceharvest/b70-vllm:v0.31.0-b70.3"', "")
    cfg = config.parse(text, B70)
    unit = render_all(cfg, layout(Scope.SYSTEM))["b70-vllm.service"]
    engine_s = flag_value(unit_value(unit, "ExecStart"), "--shutdown-timeout")
    unit_s = int(unit_value(unit, "TimeoutStopSec").removesuffix("s"))
    assert engine_s == int(cfg.runtimes["vllm"].stop_timeout_s)
    if launcher == "native":
        assert unit_s > engine_s
        assert "ExecStop=" not in unit
        return
    run_s = flag_value(unit_value(unit, "ExecStart"), "--stop-timeout")
    stop_s = flag_value(unit_value(unit, "ExecStop"), "--time")
    assert run_s == stop_s
    assert unit_s > stop_s > engine_s


def test_preflight_knows_installed_files_are_current_without_rendering(tmp_path: Path) -> None:
    """install's stamp: the same inputs and untouched files need no rendering (and no jinja2);
    anything else is rendered and compared, naming the file that differs."""
    from appliance.errors import ApplianceError
    from appliance.layout import PROXY_CONFIG, Layout
    from appliance.switch import preflight
    from appliance.units.rendered import installed_as_rendered, stamp

    lay = Layout(Scope.USER, tmp_path / "units", tmp_path / "etc", tmp_path / "state")
    cfg = config.parse(THREE, tmp_path / "three.toml")
    files = render_all(cfg, lay)
    names = ("b70-a.service", PROXY_CONFIG)
    assert not installed_as_rendered(cfg, lay, names), "nothing installed, no stamp"
    for name, text in files.items():
        lay.destination(name).parent.mkdir(parents=True, exist_ok=True)
        lay.destination(name).write_text(text)
    stamp(cfg, lay, files)
    assert installed_as_rendered(cfg, lay, names)
    preflight.check_installed(cfg, lay, names)

    other = config.parse(THREE.replace('"/m.gguf"', '"/n.gguf"'), cfg.path)
    assert not installed_as_rendered(other, lay, names), "another config: another digest"
    with pytest.raises(ApplianceError, match=r"b70-a\.service differs from what"):
        preflight.check_installed(other, lay, names)

    lay.destination(PROXY_CONFIG).write_text(files[PROXY_CONFIG] + "# edited by hand\n")
    assert not installed_as_rendered(cfg, lay, names), "a file changed since install"
    with pytest.raises(ApplianceError, match=r"litellm\.yaml differs from what"):
        preflight.check_installed(cfg, lay, names)


def test_peers_are_deployments_of_the_same_names_and_the_proxy_may_reach_them(
    tmp_path: Path,
) -> None:
    """[peers]: each name this box serves, at each peer's proxy with the fleet's key, the
    router's retries and cooldowns, the shared Redis; the proxy unit is not loopback-only."""
    import yaml

    loopback = B70.read_text().replace('host = "0.0.0.0"', 'host = "127.0.0.1"', 1)
    path = tmp_path / "fleet.toml"
    path.write_text(loopback)
    alone = render_all(config.load(path), layout(Scope.SYSTEM))["b70-litellm.service"]
    assert "IPAddressDeny=any" in alone, "a loopback proxy without peers talks to loopback only"
    path.write_text(
        loopback + '\n[peers]\nurls = ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]\n'
        'redis_host = "10.0.0.9"\ncooldown_s = 7\n'
    )
    files = render_all(config.load(path), layout(Scope.SYSTEM))
    doc = yaml.safe_load(files["litellm.yaml"])
    peers = [d for d in doc["model_list"] if d["litellm_params"]["model"].startswith("openai/")]
    assert [(d["model_name"], d["litellm_params"]["api_base"]) for d in peers] == [
        ("qwen3.6-35b-a3b", "http://10.0.0.2:8000/v1"),
        ("qwen3.6-35b-a3b", "http://10.0.0.3:8000/v1"),
    ]
    assert {d["litellm_params"]["api_key"] for d in peers} == {"os.environ/LITELLM_MASTER_KEY"}
    assert doc["router_settings"] | {"model_group_alias": None} == {
        "model_group_alias": None, "num_retries": 2, "allowed_fails": 1, "cooldown_time": 7,
        "redis_host": "10.0.0.9", "redis_port": 6379,
    }  # fmt: skip
    proxy = files["b70-litellm.service"]
    assert "B70_PEER_URL=http://10.0.0.2:8000 http://10.0.0.3:8000" in proxy
    assert "IPAddressDeny" not in proxy
    assert "REDIS_SSL" not in proxy
    units = [n for n in files if n.endswith(UNIT_SUFFIXES)]
    assert analyze_verify(verify_root(tmp_path, files), units) == ""
    # A Redis that speaks TLS: LiteLLM's own settings, which the door's client reads too
    path.write_text(path.read_text() + 'redis_tls = true\nredis_ca = "/etc/b70/redis-ca.pem"\n')
    proxy = render_all(config.load(path), layout(Scope.SYSTEM))["b70-litellm.service"]
    assert "REDIS_SSL=True" in proxy and "REDIS_SSL_CA_CERTS=/etc/b70/redis-ca.pem" in proxy


class _States:
    """The proxy's ActiveState as a manager would report it, one answer per question."""

    def __init__(self, *states: str) -> None:
        self.states, self.waits = list(states), 0

    def active_state(self, name: str) -> str:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def wait_change(self, timeout_s: float) -> None:
        self.waits += 1


def test_a_switch_waits_for_a_proxy_on_its_way_back_and_not_for_one_that_is_down() -> None:
    """Preflight asked while systemd restarts the proxy (deactivating, then activating) waits for
    it to be active; a proxy that is failed or inactive is answered at once, and one that never
    arrives is given up after the timeout, in its last state."""
    from appliance.switch import preflight

    back = _States("deactivating", "activating", "activating", "active")
    assert preflight.proxy_settled(back, 30) == "active"  # type: ignore[arg-type]
    assert back.waits == 3
    for down in ("failed", "inactive"):
        states = _States(down)
        assert preflight.proxy_settled(states, 30) == down  # type: ignore[arg-type]
        assert states.waits == 0
    stuck = _States("activating")
    assert preflight.proxy_settled(stuck, 0.05) == "activating"  # type: ignore[arg-type]
