"""Container engines for real: a llama.cpp runtime in a container beside a native one, under a
real user manager, on a fixture B70 (the units' GPU-memory guards read it). Each test runs once with
Debian 12's podman and once with Debian 12's docker (docker.io).

The image is built here by scripts/fetch-runtime-image (a minbase Debian 12 tree and the cached
llama-server build; nothing comes from a registry) into podman's storage; docker gets it by
`podman save | docker load`. The container runs with the host's network, the GGUF bound
read-only at its own path, and `container_options` for what this host needs: the runc runtime
(crun does not run on a cgroup v1 or hybrid host) and limits no higher than the host's hard ones
(podman's defaults ask for more, and the OCI runtime's setrlimit fails).

dockerd is this module's own: started with a data root and a socket of its own (DOCKER_HOST in
the manager's environment, so the units and b70ctl reach it), stopped with its containers at the
end. Every container a test starts is gone when it ends, pass or fail.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from appliance.host import health, processes
from b70tools import gpu_trees
from b70tools.net import free_port
from tests.conftest import (
    CACHE,
    GGUF,
    LLAMA_SERVER,
    Appliance,
    appliance_on_cards,
    live_pid,
    llamacpp_counter,
)
from tests.test_faults_real import killed_under_load

IMAGE_STAMP = CACHE / "runtime-image"  # scripts/fetch-runtime-image: "REFERENCE ID"
INSIDE = "/opt/llama.cpp/llama-server"  # where the image has llama-server
PODMAN = shutil.which("podman") or "/usr/bin/podman"
# Debian's docker client, which speaks the API of Debian's dockerd (another client may come
# first on PATH).
DOCKER = "/usr/bin/docker"
DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"
LIMIT = 4096  # open files and processes of the container
RELEASE_WAIT_S = 5  # [gpu] release_timeout_s: how long the GPU-memory guard waits, then gives up


@dataclass
class Engine:
    """The engine of one run of this module, and its runtime's names. Container names are the
    machine's: another run of the suite beside this one must not meet this one's container."""

    launcher: str  # "podman" or "docker"
    cli: str
    env: dict[str, str] = field(default_factory=dict)  # how its CLI reaches its daemon

    @property
    def runtime(self) -> str:
        return f"{self.launcher}-{os.getpid()}"

    @property
    def unit(self) -> str:
        return f"b70-{self.runtime}.service"

    @property
    def container(self) -> str:
        return f"b70-{self.runtime}"

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.cli, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **self.env},
        )

    def containers(self) -> dict[str, str]:
        """This runtime's container, if the engine has it in any state: name -> state."""
        out = self(
            "inspect", "--type", "container", "--format", "{{.State.Status}}", self.container
        )
        if out.returncode == 0:
            return {self.container: out.stdout.strip()}
        # Only "no such container" means none: an engine that does not answer is a failure.
        assert "no such" in out.stderr.lower(), out.stderr
        return {}

    def container_pid(self) -> int | None:
        out = self("inspect", "--format", "{{.State.Pid}}", self.container)
        text = out.stdout.strip()
        return int(text) if out.returncode == 0 and text.isdigit() and int(text) > 0 else None

    def oci_runtime(self) -> str:
        what = "{{.OCIRuntime}}" if self.launcher == "podman" else "{{.HostConfig.Runtime}}"
        return self("inspect", "--format", what, self.container).stdout.strip()

    def remove(self) -> None:
        self("rm", "--force", self.container)


def runtime_image() -> str:
    try:
        ref = IMAGE_STAMP.read_text().split()[0]
    except (OSError, IndexError):
        pytest.fail(f"no runtime image: {IMAGE_STAMP} is missing; run scripts/fetch-runtime-image")
    if Engine("podman", PODMAN)("image", "exists", ref).returncode != 0:
        pytest.fail(f"{ref} is not in podman's storage; run scripts/fetch-runtime-image")
    return ref


@contextmanager
def own_dockerd(image: str) -> Iterator[Engine]:
    """A dockerd of this run's own, with `image` loaded from podman's storage; stopped, and its
    files deleted, at the end."""
    if not os.access(DOCKERD, os.X_OK) or not os.access(DOCKER, os.X_OK):
        pytest.fail(f"no {DOCKERD} or {DOCKER}; run scripts/fetch-runtime-image (docker.io)")
    # Not under /tmp (each runtime unit has a private one) nor /run: where /run is no mount of
    # its own (a host without systemd as PID 1), a unit with ProtectProc= gets an empty tmpfs
    # there (MountAPIVFS=, which ProtectProc= implies, mounts /run unless it is mounted).
    top = Path(tempfile.mkdtemp(prefix="test-dockerd-", dir=CACHE))
    engine = Engine("docker", DOCKER, {"DOCKER_HOST": f"unix://{top}/docker.sock"})
    argv = [
        DOCKERD,
        f"--data-root={top}/data",
        f"--exec-root={top}/exec",
        f"--pidfile={top}/dockerd.pid",
        f"--host={engine.env['DOCKER_HOST']}",
        "--bridge=none",  # the container uses the host's network; no bridge, no iptables
        "--iptables=false",
        "--ip-masq=false",
    ]
    with open(top / "dockerd.log", "wb") as log:
        daemon = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while engine("version").returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"dockerd did not answer:\n{(top / 'dockerd.log').read_text()[-3000:]}")
            time.sleep(0.2)
        saved = subprocess.Popen([PODMAN, "save", image], stdout=subprocess.PIPE)
        assert saved.stdout is not None
        loaded = subprocess.run(
            [DOCKER, "load"],
            stdin=saved.stdout,
            capture_output=True,
            text=True,
            env={**os.environ, **engine.env},
            timeout=300,
        )
        saved.stdout.close()
        assert saved.wait(timeout=60) == 0 and loaded.returncode == 0, loaded.stderr
        yield engine
    finally:
        daemon.send_signal(signal.SIGTERM)  # it stops its containers, then its containerd
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        unmount_under(top)  # dockerd leaves its network namespace's bind mount behind
        shutil.rmtree(top, ignore_errors=True)


def unmount_under(top: Path) -> None:
    """Unmount what is mounted at or under `top`, the deepest first."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    # mountinfo escapes a space in a path as \\040; `top` has none.
    for point in sorted((m for m in mounts if Path(m).is_relative_to(top)), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=30)


def limit(which: int) -> int:
    """A limit the container's llama-server has room in, never above this process's hard limit
    (podman's own defaults are above it on some hosts, and its limits for conmon lower still)."""
    hard = resource.getrlimit(which)[1]
    return LIMIT if hard == resource.RLIM_INFINITY else min(hard, LIMIT)


def container_options() -> list[str]:
    nofile, nproc = limit(resource.RLIMIT_NOFILE), limit(resource.RLIMIT_NPROC)
    limits = [f"nofile={nofile}:{nofile}", f"nproc={nproc}:{nproc}"]
    return ["--runtime", "runc", "--ulimit", limits[0], "--ulimit", limits[1]]


def config_text(engine: Engine, image: str, proxy_port: int, backend_port: int) -> str:
    return f"""
default_runtime = "llamacpp"
{engine.launcher} = "{engine.cli}"

[proxy]
port = {proxy_port}
model = "smollm2"

[backend]
port = {backend_port}

[monitor]
port = {free_port()}
probe_completion = false

[gpu]
memory_needed_gib = 2
release_timeout_s = {RELEASE_WAIT_S}

[runtimes.llamacpp]
engine = "llamacpp"
command = ["{LLAMA_SERVER}"]
model = "{GGUF}"
args = ["-c", "1024"]
memory_needed_gib = 0

[runtimes.{engine.runtime}]
engine = "llamacpp"
launcher = "{engine.launcher}"
image = "{image}"
model = "{GGUF}"
volumes = ["{GGUF.parent}:{GGUF.parent}:ro"]
container_options = {json.dumps(container_options())}
args = ["-c", "1024"]
stop_timeout_s = 10
"""


@dataclass
class EngineApp:
    app: Appliance
    engine: Engine


@pytest.fixture(scope="module", params=["podman", "docker"])
def engine_app(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineApp]:
    image = runtime_image()
    root = tmp_path_factory.mktemp(request.param)
    with started_engine(request.param, image) as engine:
        try:
            with appliance_on_cards(
                root,
                [gpu_trees.B70],
                lambda proxy, backend: config_text(engine, image, proxy, backend),
                env=engine.env,
            ) as app:
                yield EngineApp(app, engine)
        finally:
            left = engine.containers()
            engine.remove()
            assert not left, f"uninstall left a container behind: {left}"


@contextmanager
def started_engine(launcher: str, image: str) -> Iterator[Engine]:
    if launcher == "podman":
        yield Engine("podman", PODMAN)
    else:
        with own_dockerd(image) as engine:
            yield engine


def active_and_sub(app: Appliance, unit: str) -> tuple[str, str]:
    """The unit's ActiveState and SubState, as `systemctl show` gives them."""
    shown = app.manager.systemctl("show", "-p", "ActiveState,SubState", unit)
    props = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    return props.get("ActiveState", ""), props.get("SubState", "")


def hard_limit(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith(name):
            return int(line[len(name) :].split()[1])
    raise AssertionError(f"no {name!r} in /proc/{pid}/limits")


def test_the_container_serves_the_model_through_the_proxy(engine_app: EngineApp) -> None:
    app, e = engine_app.app, engine_app.engine
    app.b70ctl("switch", "llamacpp", check=True)
    prompt = "What is the capital of France? Answer in one word."
    native = app.ask(prompt)
    app.b70ctl("switch", e.runtime, check=True)
    pid = e.container_pid()
    assert pid, f"{e.launcher} knows no process of the container"
    # llama-server of the image, in the container's own file system
    assert os.readlink(f"/proc/{pid}/exe") == INSIDE
    assert os.stat(f"/proc/{pid}/root").st_ino != os.stat("/").st_ino
    # The backend port is the container's, and its /health answers through it.
    assert pid in {listener.pid for listener in processes.listeners(app.backend_port)}
    answer = health.request("GET", f"http://127.0.0.1:{app.backend_port}/health", 5)
    assert answer.status == 200, answer.text
    # The model is bound read-only; the options reached the container (its runtime, its limits).
    mounts = json.loads(e("inspect", "--format", "{{json .Mounts}}", e.container).stdout)
    model = [m for m in mounts if m["Destination"] == str(GGUF.parent)]
    assert model and model[0]["RW"] is False, mounts
    assert e.oci_runtime() == "runc"
    assert hard_limit(pid, "Max open files") == limit(resource.RLIMIT_NOFILE)
    # A completion through the proxy, with the OpenAI SDK, is generated in the container: its
    # own counter grows by the tokens of the answer. Same binary, model and greedy sampling as
    # the native runtime: the same answer.
    before = llamacpp_counter(app.backend_port, "tokens_predicted_total")
    reply = app.client().chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=12,
        timeout=120,
    )
    text = reply.choices[0].message.content or ""
    assert text.strip() and text == native
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    grown = llamacpp_counter(app.backend_port, "tokens_predicted_total") - before
    assert grown >= reply.usage.completion_tokens
    log = app.b70ctl("logs", e.runtime, "-n", "5000").stdout  # llama-server says a lot
    assert f"answers from pid {live_pid(app, e.unit)}" in log  # the unit's health guard


def test_a_switch_to_the_container_and_away_leaves_no_container(engine_app: EngineApp) -> None:
    app, e = engine_app.app, engine_app.engine
    app.b70ctl("switch", e.runtime, check=True)
    status = app.json("status")["result"]
    assert status["active_runtime"] == e.runtime
    assert e.containers() == {e.container: "running"}
    app.b70ctl("switch", "llamacpp", check=True)
    assert e.containers() == {}
    assert active_and_sub(app, e.unit)[0] == "inactive"
    assert app.json("status")["result"]["active_runtime"] == "llamacpp"
    assert app.ask().strip()
    # Once more: a container left behind under its name would make this start fail.
    app.b70ctl("switch", e.runtime, check=True)
    assert e.containers() == {e.container: "running"}
    app.b70ctl("switch", "llamacpp", check=True)
    assert e.containers() == {}


def test_the_container_killed_under_load_loses_no_request(engine_app: EngineApp) -> None:
    """SIGKILL of llama-server in the container while 4 clients send requests: `podman run` or
    `docker run` ends, systemd starts the unit again (a new container of the same name).
    Requests in flight are held at the proxy and sent again; none fails."""
    app, e = engine_app.app, engine_app.engine
    app.b70ctl("switch", e.runtime, check=True)
    restarts = int(app.manager.systemctl("show", "-p", "NRestarts", "--value", e.unit).strip())
    killed = killed_under_load(
        app, 4, lambda: e.container_pid() or 0, "the container's llama-server"
    )
    journal = app.b70ctl("logs", "proxy", "-n", "300").stdout
    assert journal.count("sent again") >= 1, journal[-3000:]
    again = int(app.manager.systemctl("show", "-p", "NRestarts", "--value", e.unit).strip())
    assert again == restarts + 1
    assert e.container_pid() not in (None, killed)
    assert e.containers() == {e.container: "running"}
    app.b70ctl("switch", "llamacpp", check=True)
    assert e.containers() == {}


def test_the_memory_guard_refuses_the_container_and_the_native_runtime_serves_again(
    engine_app: EngineApp,
) -> None:
    """Between the switch's preflight and the container's start, a foreign process takes the
    card's memory: the unit's own GPU-memory guard (ExecStartPre) waits, gives up, and the
    switch rolls back. Here b70ctl reads the idle fixture card and the units a busy one."""
    app, e = engine_app.app, engine_app.engine
    app.b70ctl("switch", "llamacpp", check=True)
    t = gpu_trees
    busy_root = Path(tempfile.mkdtemp(prefix="test-sysroot-", dir=CACHE))  # not in /tmp
    try:
        busy = t.build(
            busy_root,
            [t.Card(t.B70, vram_used=31 * t.GIB + 700 * 1024**2)],
            [t.foreign(resident="31 GiB")],
        )
        app.manager.systemctl("set-environment", f"B70_SYSROOT={busy}")
        out = app.b70ctl("switch", e.runtime)
    finally:
        app.manager.systemctl("set-environment", f"B70_SYSROOT={app.manager.env['B70_SYSROOT']}")
        shutil.rmtree(busy_root, ignore_errors=True)
    assert out.returncode == 1, out.stderr
    assert f"switch to {e.runtime} failed" in out.stderr
    assert "rolled back: llamacpp is serving again" in out.stderr
    log = app.b70ctl("logs", e.runtime, "-n", "100").stdout
    assert (
        f"GPU memory was not free within {RELEASE_WAIT_S} s: 0000:03:00.0: 0.3 GiB free of 32.0 GiB"
        ", need 2.0 GiB; held by pid 5151 (python3 train.py --epochs 3) in session-3.scope"
    ) in log, log[-3000:]
    assert e.containers() == {}, "the container ran though its guard refused it"
    assert app.json("status")["result"]["active_runtime"] == "llamacpp"
    assert app.ask().strip()


class PortTaker(threading.Thread):
    """Takes the backend port the moment the native runtime lets go of it, and listens there
    until the container's unit has left its ExecStartPre (its port guard refused it)."""

    def __init__(self, app: Appliance, unit: str) -> None:
        super().__init__(daemon=True)
        self.app = app
        self.unit = unit
        self.held_at: float | None = None
        self.saw_guard = False
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 300
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            while not self.stop.is_set() and time.monotonic() < deadline:
                try:
                    sock.bind(("127.0.0.1", self.app.backend_port))
                    break
                except OSError:
                    time.sleep(0.001)
            else:
                return
            sock.listen()
            self.held_at = time.monotonic()
            while not self.stop.is_set() and time.monotonic() < deadline:
                sub = active_and_sub(self.app, self.unit)[1]
                if sub == "start-pre":
                    self.saw_guard = True
                elif self.saw_guard:
                    return  # the guard has given up: the port is the rollback's
                time.sleep(0.05)


def test_the_port_guard_refuses_the_container_and_the_native_runtime_serves_again(
    engine_app: EngineApp,
) -> None:
    """The native runtime stops, and another process takes its port before the container
    starts: the unit's port guard (ExecStartPre) names it and refuses, no container runs, and the
    switch rolls back to the native runtime once the port is free again."""
    app, e = engine_app.app, engine_app.engine
    app.b70ctl("switch", "llamacpp", check=True)
    taker = PortTaker(app, e.unit)
    taker.start()
    try:
        out = app.b70ctl("switch", e.runtime)
    finally:
        taker.stop.set()
        taker.join()
    assert taker.held_at is not None and taker.saw_guard
    assert out.returncode == 1, out.stderr
    assert "rolled back: llamacpp is serving again" in out.stderr
    log = app.b70ctl("logs", e.runtime, "-n", "100").stdout
    assert f"port {app.backend_port} is in use by pid {os.getpid()}" in log, log[-3000:]
    assert e.containers() == {}
    assert app.json("status")["result"]["active_runtime"] == "llamacpp"
    assert app.ask().strip()
