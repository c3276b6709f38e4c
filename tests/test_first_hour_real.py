"""A B70 owner's first hour, as far as it can run here: the README's three commands on a fresh
Debian 12 box booted with systemd as PID 1 (tests/boxkit.py), which end serving on :8000.

What stands in for what this machine has not:
- the cards: a fixture tree of one B70 (then of two) in the kernel's formats (b70tools.gpu_trees),
  named by B70_SYSROOT in every login shell (and kept by sudo) and in the manager's environment; /dev/dri's nodes are made as /dev/null's (char 1:3) under the cards' names, so
  that `--device` has nodes to pass;
- the hub: a folder served in the hub's URL layout (b70tools.hubdir) inside the box, named by
  HF_ENDPOINT; its Qwen3.6-35B-A3B repositories hold SmolLM2's GGUF under the recipe's file
  name, a small projector, and the real model's config.json (tests/fixtures/b70) with a small
  safetensors file;
- the registries: images in the published images' shape, built here from the suite's own
  llama-server image and loaded into the box's podman under the published names. llama.cpp's
  has its llama-server at /app/llama-server, its entrypoint (a CPU build that leaves out the
  projector, which no small model here has); the vLLM one runs the B70 stand-in
  (b70tools.b70_engine) as its entrypoint, at 0.02 of a B70's times.
- The first command, `scripts/install`, downloads from PyPI, and the box has no network: its
  result, /opt/b70 with the locked dependencies and the appliance, is made the way
  tests/test_system_box_real.py makes it, and `test_scripts_install_into_a_prefix` runs the
  script itself on this machine.

The box has podman and no docker, so setup writes the runtimes for podman. What needs a real card
and a registry: the xe driver's answers, SYCL and Level Zero in the images, their download.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from appliance.deploy import setup as setup_mod
from b70tools import gpu_trees
from tests import boxkit
from tests.conftest import GGUF, REPO
from tests.test_doctor import GGUF as TINY_TENSORS
from tests.test_doctor import gguf_bytes, safetensors_bytes
from tests.test_engines_real import PODMAN, runtime_image

Staged = tuple[boxkit.Fetched, Path, dict[Path, str]]
BoxOf = Callable[[list[str]], AbstractContextManager[boxkit.Box]]
HUB_PORT = 8090
# The B70 stand-in's server (starlette under uvicorn) and what they import, into its image.
SERVER_PACKAGES = ("uvicorn", "starlette", "anyio", "sniffio", "idna", "h11", "click",
                   "typing_extensions")  # fmt: skip
FIXTURE = "/srv/b70-fixture"
HUB = "/srv/hub"
LLAMA_REPO, LLAMA_FILE = setup_mod.GGUF[3:].rsplit("/", 1)
MMPROJ_FILE = setup_mod.MMPROJ.rsplit("/", 1)[1]
VLLM_REPO = setup_mod.VLLM_MODEL[3:]
NAME = "qwen3.6-35b-a3b"
CONTAINERS_CONF = """\
# systemd-nspawn keeps the cgroup controllers and the kernel keyring from a box's services
# (tests/test_system_box_podman_real.py): crun, no cgroups of the container's own, no keyring.
[containers]
keyring = false
cgroups = "disabled"

[engine]
runtime = "crun"
"""
# The stand-in of llama.cpp's server-intel image's /app/llama-server: the suite's CPU build,
# without the vision projector.
LLAMA_WRAPPER = """\
#!/bin/sh
skip=
for arg; do
    shift
    if [ -n "$skip" ]; then skip=; continue; fi
    if [ "$arg" = --mmproj ]; then skip=1; continue; fi
    set -- "$@" "$arg"
done
exec /opt/llama.cpp/llama-server "$@"
"""


def _podman(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"podman {' '.join(args)}:\n{out.stderr}"
    return out


def published_images(where: Path) -> Path:
    """Both stand-in images, built from the suite's llama-server image under the published names,
    saved into one archive for the box's podman."""
    base = runtime_image()
    llama = where / "llama"
    llama.mkdir()
    (llama / "llama-server").write_text(LLAMA_WRAPPER)
    (llama / "llama-server").chmod(0o755)
    (llama / "Containerfile").write_text(
        f"FROM {base}\nCOPY llama-server /app/llama-server\nWORKDIR /app\n"
        'ENV LLAMA_ARG_HOST=0.0.0.0\nENTRYPOINT ["/app/llama-server"]\nCMD []\n'
    )
    vllm = where / "vllm"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("appliance", "b70tools"):
        shutil.copytree(REPO / name, vllm / "standin" / name, ignore=skip)
    for name in SERVER_PACKAGES:  # what the stand-in serves with, pure Python, from this venv
        found = Path(importlib.util.find_spec(name).origin or "")  # type: ignore[union-attr]
        if found.name == "__init__.py":
            shutil.copytree(found.parent, vllm / "standin" / name, ignore=skip)
        else:
            shutil.copy2(found, vllm / "standin" / found.name)
    (vllm / "Containerfile").write_text(
        f"FROM {base}\nCOPY standin /opt/standin\nWORKDIR /\n"
        "ENV PYTHONPATH=/opt/standin B70_STANDIN_SCALE=0.02\n"
        'ENTRYPOINT ["python3", "-m", "b70tools.b70_engine", "vllm"]\nCMD []\n'
    )
    names = [setup_mod.LLAMACPP_IMAGE, setup_mod.VLLM_IMAGE]
    for context, name in zip((llama, vllm), names, strict=True):
        _podman("build", "--quiet", "--pull=never", "-t", name, str(context))
    archive = where / "images.tar"
    try:
        _podman("save", "--quiet", "--multi-image-archive", "-o", str(archive), *names)
    finally:
        subprocess.run([PODMAN, "rmi", "--force", *names], capture_output=True, check=False)
    return archive


def hub_folder(where: Path) -> Path:
    """The two repositories setup names, as the local hub serves them."""
    llama = where / LLAMA_REPO
    llama.mkdir(parents=True)
    shutil.copyfile(GGUF, llama / LLAMA_FILE)
    (llama / MMPROJ_FILE).write_bytes(gguf_bytes(TINY_TENSORS))
    vllm = where / VLLM_REPO
    vllm.mkdir(parents=True)
    shutil.copyfile(REPO / "tests/fixtures/b70/Qwen-Qwen3.6-35B-A3B.json", vllm / "config.json")
    (vllm / "model.safetensors").write_bytes(safetensors_bytes())
    return where


@pytest.fixture(scope="module")
def staged() -> Iterator[Staged]:
    missing = [str(p) for p in (GGUF,) if not p.exists()]
    assert not missing, f"missing {missing}: run scripts/fetch-model"
    fetched = boxkit.fetch()
    with tempfile.TemporaryDirectory(prefix="first-hour-", dir=boxkit.CACHE) as tmp:
        work = Path(tmp)
        wheel = boxkit.appliance_wheel(fetched.wheels, work)
        (work / "images").mkdir()
        images = published_images(work / "images")
        hub = hub_folder(work / "hub")
        binds = {fetched.wheels: "/wheels", wheel: "/wheels-app", images: "/mnt/images.tar",
                 hub: "/mnt/hub", REPO / "b70tools": "/opt/hubdir/b70tools"}  # fmt: skip
        yield fetched, work, binds


@pytest.fixture
def box_of(staged: Staged) -> Iterator[BoxOf]:
    """A booted box for a fixture of these cards, made ready for the README's commands."""
    fetched, work, binds = staged

    @contextmanager
    def make(cards: list[str]) -> Iterator[boxkit.Box]:
        with tempfile.TemporaryDirectory(prefix="fixture-", dir=work) as tmp:
            tree = gpu_trees.healthy_host(Path(tmp) / "root", cards, memory_kib=128 * 1024**2)
            with boxkit.booted_box(fetched.ready, {**binds, tree: "/mnt/fixture"},
                                   capabilities=("CAP_PERFMON",)) as box:  # fmt: skip
                prepare(box, cards)
                yield box

    yield make


def prepare(box: boxkit.Box, cards: list[str]) -> None:
    """The box as a B70 host whose owner has not run anything yet, but for what stands in."""
    # The first command's result (scripts/install needs the network the box has not).
    box.run(
        "/opt/b70/bin/pip install --quiet --no-index --find-links /wheels "
        "--find-links /wheels-app b70-appliance && ln -s /opt/b70/bin/b70ctl /usr/local/bin/b70ctl",
        timeout=900,
    )
    box.run(f"cp -a /mnt/fixture {FIXTURE} && cp -a /mnt/hub {HUB}")
    box.run("mkdir -p /dev/dri/by-path")
    for i, slot in enumerate(cards):  # the nodes, and the links udev makes to them
        for node, kind in ((f"card{i + 1}", "card"), (f"renderD{128 + i}", "render")):
            box.run(f"mknod -m 0666 /dev/dri/{node} c 1 3 && "
                    f"ln -s ../{node} /dev/dri/by-path/pci-{slot}-{kind}")  # fmt: skip
    env = {"B70_SYSROOT": FIXTURE, "HF_ENDPOINT": f"http://127.0.0.1:{HUB_PORT}"}
    # Every login shell has them, and sudo keeps them: the README's commands, as written, see them.
    box.write("/etc/profile.d/b70-fixture.sh", "".join(f"export {k}={v}\n" for k, v in env.items()))
    box.write("/etc/sudoers.d/b70-fixture", f'Defaults env_keep += "{" ".join(env)}"\n', "0440")
    box.run("echo '127.0.1.1 box' >> /etc/hosts")
    box.run("systemctl set-environment " + " ".join(f"{k}={v}" for k, v in env.items()))
    box.run(
        f"systemd-run --unit=hub --property=Environment=PYTHONPATH=/opt/hubdir "
        f"python3 -m b70tools.hubdir {HUB} --port {HUB_PORT}"
    )
    box.write("/etc/containers/containers.conf", CONTAINERS_CONF)


def readme(box: boxkit.Box, command: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """One of the README's commands, as written, as root in the box."""
    started = time.monotonic()
    out = box.run(command, check=False, timeout=timeout)
    took = time.monotonic() - started
    print(f"\n$ {command}  (exit {out.returncode} in {took:.1f} s)\n{out.stdout[-4000:]}"
          f"{out.stderr[-4000:]}")  # fmt: skip
    if out.returncode != 0:  # what the units said, for whoever reads a failure
        journal = box.run("journalctl --no-pager -o cat -n 60 -u 'b70-*'", check=False)
        print(f"the units' journal:\n{journal.stdout}")
    assert "Traceback" not in out.stderr
    return out


def chat(box: boxkit.Box, model: str = NAME) -> str:
    key = box.read("/etc/b70/proxy.env").split("=", 1)[1].strip()
    body = json.dumps({"model": model, "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hello"}]})  # fmt: skip
    out = box.run(
        f"curl -sS --fail-with-body -m 120 http://127.0.0.1:8000/v1/chat/completions "
        f"-H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}",
        timeout=130,
    )
    content: str = json.loads(out.stdout)["choices"][0]["message"]["content"]
    return content


def serving(box: boxkit.Box) -> list[str]:
    data = json.loads(box.run("b70ctl status --json").stdout)["result"]
    return sorted(data["active_runtimes"])


def test_scripts_install_into_a_prefix(tmp_path: Path) -> None:
    """The first command, on this machine: the locked dependencies from PyPI, each checked
    against its hash, and the appliance from the checkout, into a prefix of its own."""
    prefix, bin_dir = tmp_path / "b70", tmp_path / "bin"
    bin_dir.mkdir()
    env = {**os.environ, "B70_PREFIX": str(prefix), "B70_BIN": str(bin_dir)}
    try:
        started = time.monotonic()
        out = subprocess.run([str(REPO / "scripts" / "install")], env=env, capture_output=True,
                             text=True, timeout=1800, check=False)  # fmt: skip
        print(f"\nscripts/install: exit {out.returncode} in {time.monotonic() - started:.1f} s")
        assert out.returncode == 0, out.stderr[-3000:]
        link = bin_dir / "b70ctl"
        assert link.resolve() == (prefix / "bin" / "b70ctl").resolve()
        version = subprocess.run(
            [str(link), "--version"], capture_output=True, text=True, check=False
        )
        assert version.returncode == 0 and "b70ctl" in version.stdout
        assert "next: sudo b70ctl setup" in out.stderr
    finally:
        shutil.rmtree(prefix, ignore_errors=True)  # 769 MB, not left for pytest's kept folders


def test_three_commands_on_one_b70_end_serving(box_of: BoxOf) -> None:
    with box_of([gpu_trees.B70]) as box:
        setup = readme(box, "sudo b70ctl setup")
        assert setup.returncode == 0
        written = box.read("/etc/b70/appliance.toml")
        assert 'launcher = "podman"' in written and 'launcher = "docker"' not in written
        # The models pulled with their progress; then an image missing: install pulls it, and
        # with no registry it fails, naming it.
        missing = readme(box, "sudo b70ctl install")
        assert missing.returncode == 1
        assert f"llamacpp: hf:{LLAMA_REPO}/{LLAMA_FILE}, 2 files" in missing.stderr
        assert "100.0%" in missing.stderr
        assert f"podman pull {setup_mod.LLAMACPP_IMAGE} failed" in missing.stderr
        assert not box.exists("/etc/systemd/system/b70-litellm.service")  # nothing installed
        box.run("podman load --quiet -i /mnt/images.tar", timeout=600)
        installed = readme(box, "sudo b70ctl install")
        assert installed.returncode == 0
        assert "to fetch" not in installed.stderr  # pulled once
        assert serving(box) == ["vllm"]
        assert chat(box).strip()
        switched = readme(box, "sudo b70ctl switch llamacpp", timeout=600)
        assert switched.returncode == 0
        assert serving(box) == ["llamacpp"]
        assert chat(box).strip()
        # llama.cpp's image, at its published path
        pid = box.run("podman inspect --format '{{.State.Pid}}' b70-llamacpp").stdout.strip()
        assert box.run(f"cat /proc/{pid}/cmdline | tr '\\0' ' '").stdout.startswith(
            "/opt/llama.cpp/llama-server --model /srv/b70/models/"
        )
        # vLLM's image again: its container finds the graph the first start compiled, through
        # the cache folder's mount (docs/caches.md); a mount or variable gone is a cold start
        back = json.loads(box.run("b70ctl switch vllm --json", timeout=600).stdout)
        assert back["ok"] and back["result"]["start"]["verdict"] == "warm", back
        graphs = box.run("find /var/cache/b70-vllm -name vllm_compile_cache.py").stdout.split()
        assert len(graphs) == 1 and "/vllm/torch_compile_cache/" in graphs[0], graphs


def test_three_commands_on_two_b70s_end_serving(box_of: BoxOf) -> None:
    with box_of([gpu_trees.B70, gpu_trees.B70_2]) as box:
        box.run("podman load --quiet -i /mnt/images.tar", timeout=600)
        assert readme(box, "sudo b70ctl setup").returncode == 0
        written = box.read("/etc/b70/appliance.toml")
        assert "tensor parallelism over 2 cards" in written and "per_card = true" in written
        assert readme(box, "sudo b70ctl install").returncode == 0
        assert serving(box) == ["vllm"]
        assert chat(box).strip()
        assert readme(box, "sudo b70ctl switch llamacpp", timeout=600).returncode == 0
        assert serving(box) == ["llamacpp-0", "llamacpp-1"]
        assert chat(box, "qwen3.6-35b-a3b-gguf").strip()


def test_no_cards_is_said_by_setup_and_by_install(box_of: BoxOf) -> None:
    with box_of([]) as box:
        setup = readme(box, "sudo b70ctl setup")
        assert setup.returncode == 1 and "no Intel GPU here to serve" in setup.stderr
        assert not box.exists("/etc/b70/appliance.toml")
