"""podman under a real system manager: the README's "On a real B70" path in the Debian 12 box, with
a llama.cpp runtime in a container beside a native one.

The box's podman is Debian 12's (4.3.1). On a host whose cgroups are v1 or hybrid, a box gets
the v1 controllers' hierarchies read-only, so no OCI runtime can make a container's cgroups
there: runc fails with "mkdir /sys/fs/cgroup/cpuset/machine.slice: read-only file system", and
runc refuses `--cgroups=disabled`. crun runs a container without cgroups of its own, which then
stays in its unit's cgroup; and systemd-nspawn refuses the kernel keyring to the box's
services, so the box's containers.conf turns off podman's keyring per container. The image is
scripts/fetch-runtime-image's, saved from the host's podman and loaded into the box's: nothing
comes from a registry. One box and one install for the module; the tests run in order, and
uninstall --purge ends it.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import boxkit
from tests.test_engines_real import INSIDE, PODMAN, runtime_image
from tests.test_system_box_real import (
    B70CTL,
    BOX_GGUF,
    MODELS,
    Clients,
    b70ctl,
    box_now,
    complete,
    judged,
    native_runtime,
    readme_box,
    serving,
    unit_show,
)

POD = "llamacpp-pod"
UNIT = f"b70-{POD}.service"
CONTAINER = f"b70-{POD}"
NATIVE = "llamacpp"

CONFIG_HEAD = f"""\
default_runtime = "{NATIVE}"
b70ctl = "{B70CTL}"

[proxy]
host = "0.0.0.0"
port = 8000
model = "smollm2"
hold_s = 120

[backend]
host = "127.0.0.1"
port = 8001

{native_runtime(NATIVE, 2)}"""


def config(image: str) -> str:
    return (
        CONFIG_HEAD
        + f"""
[runtimes.{POD}]
engine = "llamacpp"
launcher = "podman"
image = "{image}"
model = "{BOX_GGUF}"
volumes = ["{MODELS}:{MODELS}:ro"]
container_options = ["--runtime", "crun", "--cgroups=disabled"]
start_timeout_s = 120
stop_timeout_s = 10
args = ["-c", "2048", "--parallel", "2", "--threads", "1"]
"""
    )


@pytest.fixture(scope="module")
def installed() -> Iterator[boxkit.Box]:
    image = runtime_image()
    with tempfile.TemporaryDirectory(prefix="box-image-", dir=boxkit.CACHE) as tmp:
        archive = Path(tmp) / "image.tar"
        saved = subprocess.run(
            [PODMAN, "save", "--quiet", "-o", str(archive), image],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert saved.returncode == 0, saved.stderr
        with readme_box(config(image), {archive: "/mnt/image.tar"}) as box:
            box.run("podman load --quiet -i /mnt/image.tar", timeout=300)
            # systemd-nspawn's seccomp filter refuses the kernel keyring to everything the box's
            # systemd starts (keyrings have no namespace): no session keyring per container.
            box.write("/etc/containers/containers.conf", "[containers]\nkeyring = false\n")
            # CPU runtimes in a box with no B70: doctor, which install runs first on the system
            # manager, would stop at the cards.
            out = b70ctl(box, "install", "--no-doctor", timeout=600)
            print(f"\nb70ctl install:\n{out.stdout}{out.stderr}")
            assert out.returncode == 0, out.stdout + out.stderr
            yield box


def containers(box: boxkit.Box) -> dict[str, str]:
    """Every container the box's podman has, in any state: name -> state."""
    out = box.run("podman ps --all --format json").stdout
    return {n: c["State"] for c in json.loads(out or "[]") for n in c["Names"]}


def container_pid(box: boxkit.Box) -> int:
    """The container's llama-server as the box numbers it; 0 while there is none."""
    cmd = f"podman inspect --format '{{{{.State.Pid}}}}' {CONTAINER}"
    text = box.run(cmd, check=False).stdout.strip()
    return int(text) if text.isdigit() else 0


def test_the_container_serves_through_8000(installed: boxkit.Box) -> None:
    box = installed
    assert serving(box) == NATIVE
    native = complete(box)
    out = b70ctl(box, "switch", POD)
    assert out.returncode == 0, out.stdout + out.stderr
    assert serving(box) == POD
    pid = container_pid(box)
    assert pid > 0, box.journal(UNIT)
    # llama-server of the image, in a root of its own, listening on the backend port
    assert box.run(f"readlink /proc/{pid}/exe").stdout.strip() == INSIDE
    roots = box.run(f"stat -Lc %i /proc/{pid}/root /proc/1/root").stdout.split()
    assert roots[0] != roots[1]
    listeners = box.run("ss -Hltnp 'sport = :8001'").stdout
    assert f"pid={pid}," in listeners, listeners
    # No cgroup of its own: the container is supervised in its unit's.
    cgroup = box.run(f"cat /proc/{pid}/cgroup").stdout
    assert f"/system.slice/{UNIT}" in cgroup, cgroup
    # The same binary, model and greedy sampling as the native runtime: the same answer.
    assert complete(box) == native
    assert containers(box) == {CONTAINER: "running"}


def test_the_container_killed_under_load_loses_no_request(installed: boxkit.Box) -> None:
    """SIGKILL of the container's llama-server while four clients stream with no retries:
    systemd starts the unit again, and the proxy holds the requests meanwhile and sends again
    those that died before their first byte: none fails. A stream the dead server had begun
    ends short (its bytes reached the client; nothing can send it again)."""
    box = installed
    assert serving(box) == POD
    killed = container_pid(box)
    restarts = int(unit_show(box, UNIT, "NRestarts")["NRestarts"])
    with Clients(box, 4, retries=0) as clients:
        time.sleep(3)
        killed_at = box_now(box)
        box.run(f"kill -9 {killed}")
        deadline = time.monotonic() + 180
        while (
            container_pid(box) in (0, killed)
            or unit_show(box, UNIT, "ActiveState")["ActiveState"] != "active"
        ):
            assert time.monotonic() < deadline, box.journal(UNIT)
            time.sleep(0.5)
        time.sleep(15)  # each client's request after the kill runs to its end (24 tokens)
        data = clients.stop()
    results = judged(data["requests"])
    after = int(unit_show(box, UNIT, "NRestarts")["NRestarts"])
    back = [r["ended"] - killed_at for r in data["requests"] if r["sent"] > killed_at]
    print(
        f"\ncontainer SIGKILL under load: {len(data['requests'])} requests, "
        + ", ".join(f"{k} {len(v)}" for k, v in results.items())
        + f"; NRestarts {restarts} -> {after}; first answer to a request sent after the kill "
        f"{min(back, default=float('nan')):.1f} s after it"
    )
    for r in results["failed"] + results["truncated"]:
        print("  ", r)
    assert results["failed"] == []
    assert all(r["sent"] < killed_at < r["ended"] for r in results["truncated"])
    assert any(r["sent"] > killed_at for r in results["succeeded"])
    assert after == restarts + 1
    assert containers(box) == {CONTAINER: "running"}


def test_a_switch_away_leaves_no_container(installed: boxkit.Box) -> None:
    box = installed
    out = b70ctl(box, "switch", NATIVE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert serving(box) == NATIVE
    assert containers(box) == {}
    assert unit_show(box, UNIT, "ActiveState")["ActiveState"] == "inactive"
    assert complete(box).strip()


def test_uninstall_purge_leaves_no_container_and_the_image(installed: boxkit.Box) -> None:
    box = installed
    b70ctl(box, "switch", POD)  # so that uninstall must stop a running container
    assert containers(box) == {CONTAINER: "running"}
    out = b70ctl(box, "uninstall", "--purge", timeout=300)
    print(f"\nb70ctl uninstall --purge (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert containers(box) == {}
    units = box.run("systemctl list-units --all --no-legend --plain 'b70*'").stdout.strip()
    assert units == ""
    # The owner's image is theirs: purge removes what the appliance made, not what it ran.
    images = box.run("podman images --format '{{.Repository}}:{{.Tag}}'").stdout.split()
    assert any(i.startswith("localhost/b70-llama-server:") for i in images), images
