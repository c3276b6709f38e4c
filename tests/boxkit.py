"""A Debian 12 box booted with systemd as PID 1 under systemd-nspawn: the system manager for real.

scripts/fetch-box builds the tree once into the cache, and the wheelhouse the box installs the
appliance from (the box has no network but its own loopback). `booted_box` boots a copy of the
tree, so a run never changes the cache, and always powers it off and deletes the copy after.
Commands run inside through nsenter, as root or (setpriv) as another account.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import CACHE, REPO

BOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Fetched:
    tree: Path  # the Debian 12 tree
    wheels: Path  # every dependency of the appliance, as wheels for the box's Python
    ready: Path  # the tree with those installed into /opt/b70 the README's way


def fetch() -> Fetched:
    """scripts/fetch-box: instant once the cache holds them (scripts/test runs it first)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "fetch-box")], capture_output=True, text=True, timeout=1800
    )
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 3:
        raise AssertionError(f"scripts/fetch-box failed (exit {out.returncode}):\n{out.stderr}")
    return Fetched(Path(lines[0]), Path(lines[1]), Path(lines[2]))


def appliance_wheel(wheels: Path, dest: Path) -> Path:
    """The appliance's wheel from the checkout as it is now, built offline (setuptools from the
    wheelhouse) from a copy, so that building writes nothing into the checkout."""
    src = dest / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("appliance", "templates", "b70tools"):
        shutil.copytree(REPO / name, src / name, ignore=skip)
    out_dir = dest / "wheel"
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index"]
    argv += ["--find-links", str(wheels), "--wheel-dir", str(out_dir), str(src)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    shutil.rmtree(src, ignore_errors=True)
    if out.returncode != 0:
        raise AssertionError(f"building the appliance's wheel failed:\n{out.stderr}")
    return out_dir


# Commands inside get the box's environment, none of this process's (pip's settings and the like).
CLEAN_ENV = ("env", "-i", "HOME=/root", "LANG=C.UTF-8", f"PATH={BOX_PATH}")


@dataclass
class Box:
    """A booted box: its PID 1 as the host sees it, and its root as a copy of the tree."""

    leader: int
    root: Path
    console: Path

    def run(
        self,
        cmd: str,
        user: str | None = None,
        check: bool = True,
        timeout: float = 120,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """`cmd` in bash inside the box: as root, or as `user` with that account's ids, groups
        and home and nothing of root's (setpriv: no PAM session, which would write files of
        its own for the account)."""
        argv = ["nsenter", "-t", str(self.leader), "-a", "--", *CLEAN_ENV, "/bin/bash", "-lc"]
        if user is None:
            argv.append(cmd)
        else:
            u = shlex.quote(user)
            argv.append(
                f"home=$(getent passwd {u} | cut -d: -f6) && exec setpriv --reuid={u} "
                f'--regid={u} --init-groups env -i HOME="$home" USER={u} LOGNAME={u} '
                f"LANG=C.UTF-8 PATH={BOX_PATH} /bin/bash -c {shlex.quote(cmd)}"
            )
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, input=input, check=False
        )
        if check and out.returncode != 0:
            who = user or "root"
            raise AssertionError(
                f"in the box, as {who}: {cmd}\nexited {out.returncode}\n"
                f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
            )
        return out

    def read(self, path: str) -> str:
        return self.run(f"cat {shlex.quote(path)}").stdout

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        q = shlex.quote(path)
        self.run(f"install -D -m {mode} /dev/stdin {q}", input=text)

    def exists(self, path: str) -> bool:
        return self.run(f"test -e {shlex.quote(path)}", check=False).returncode == 0

    def main_pid(self, unit: str, timeout_s: float = 60) -> int:
        """The unit's main process, as the box numbers it; never 0 (a unit between starts)."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.run(f"systemctl show -p MainPID --value {shlex.quote(unit)}").stdout
            if text.strip().isdigit() and int(text) > 1:
                return int(text)
            if time.monotonic() > deadline:
                raise AssertionError(f"{unit} has no main process after {timeout_s:g} s")
            time.sleep(0.2)

    def journal(self, unit: str, lines: int = 40) -> str:
        cmd = f"journalctl --no-pager -n {lines} -u {shlex.quote(unit)}"
        return self.run(cmd, check=False).stdout


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        found: list[int] = []
        for task in tasks:
            with contextlib.suppress(OSError):
                found += [int(p) for p in (task / "children").read_text().split()]
        return found
    except OSError:
        return []


def _box_init(pid: int) -> int | None:
    """The child of systemd-nspawn that is PID 1 in its own PID namespace: the box's systemd."""
    for child in _children(pid):
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{child}/status").read_text().splitlines()
            nspid = next((line.split() for line in status if line.startswith("NSpid:")), [])
            # Once it runs systemd: before that it is nspawn still, setting up the box's mounts.
            running = Path(f"/proc/{child}/comm").read_text().strip() == "systemd"
            if len(nspid) > 2 and nspid[-1] == "1" and running:
                return child
    return None


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


@contextmanager
def booted_box(
    tree: Path,
    binds: Mapping[Path, str] | None = None,
    capabilities: tuple[str, ...] = (),
    boot_timeout_s: float = 120,
) -> Iterator[Box]:
    """A copy of `tree` booted with systemd as PID 1, each host path of `binds` read-only at its
    path in the box; powered off (killed if it hangs) and its copy deleted, however the block
    ends. Its network is its own loopback alone. `capabilities`: more than systemd-nspawn keeps
    for a box by default (which leaves out CAP_PERFMON, for one)."""
    if shutil.which("systemd-nspawn") is None:
        raise AssertionError("systemd-nspawn is missing: run scripts/fetch-box")
    work = Path(tempfile.mkdtemp(prefix="box-run-", dir=CACHE))
    root = work / "root"
    console = work / "console.log"
    nspawn: subprocess.Popen[bytes] | None = None
    leader = 0
    try:
        subprocess.run(["cp", "-a", "--reflink=auto", str(tree), str(root)], check=True)
        argv = ["systemd-nspawn", "-D", str(root), "--register=no", "--keep-unit"]
        argv.append("--private-network")  # no network but its own loopback
        if capabilities:
            argv.append("--capability=" + ",".join(capabilities))
        argv += [f"--bind-ro={host.resolve()}:{dest}" for host, dest in (binds or {}).items()]
        with open(console, "wb") as log:
            nspawn = subprocess.Popen(
                [*argv, "-b"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 30
        while not (found := _box_init(nspawn.pid)):
            if nspawn.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"systemd-nspawn did not start the box:\n{_tail(console)}")
            time.sleep(0.05)
        leader = found
        # Its manager's socket first: a command entering the box earlier can stall its boot.
        private = Path(f"/proc/{leader}/root/run/systemd/private")
        while not private.exists():
            if nspawn.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the box's systemd did not start:\n{_tail(console)}")
            time.sleep(0.05)
        box = Box(leader, root, console)
        wait = f"timeout {boot_timeout_s:g} systemctl is-system-running --wait"
        system_state = box.run(wait, check=False, timeout=boot_timeout_s + 10).stdout.strip()
        if system_state != "running":
            failed = box.run("systemctl --failed --no-legend", check=False).stdout
            raise AssertionError(
                f"the box did not boot cleanly: {system_state!r}; failed units:\n{failed}\n"
                f"console:\n{_tail(console)}"
            )
        yield box
    finally:
        if nspawn is not None:
            _power_off(nspawn, leader)
        shutil.rmtree(work, ignore_errors=True)


def _power_off(nspawn: subprocess.Popen[bytes], leader: int) -> None:
    if nspawn.poll() is None and leader:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(
                ["nsenter", "-t", str(leader), "-a", *CLEAN_ENV, "systemctl", "poweroff"],
                capture_output=True,
                timeout=30,
            )
        with contextlib.suppress(subprocess.TimeoutExpired):
            nspawn.wait(60)
    if nspawn.poll() is None:
        # It hangs: PID 1 of the box takes every process of the box with it.
        if leader:
            _kill(leader)
        with contextlib.suppress(subprocess.TimeoutExpired):
            nspawn.wait(10)
        if nspawn.poll() is None:
            _kill(nspawn.pid)
            nspawn.wait(10)
