"""The README's "On a real B70" path, as an owner runs it, under a real system manager.

A Debian 12 box booted with systemd as PID 1 (tests/boxkit.py), on CPU: the appliance in
/opt/b70 from the checkout's wheel, /etc/b70/appliance.toml with two llama.cpp runtimes serving
one public name, llama-server at /opt/llama.cpp/bin, the owner's GGUF in /srv/b70/models
(outside the state directory). One box and one install for the module; the tests run in order
(doctor, install, the sandboxes, the status page, switches under load, the faults, a colleague
without root), and uninstall --purge ends it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests import boxkit
from tests.conftest import GGUF, LLAMA_SERVER, REPO

MODELS = "/srv/b70/models"
BOX_GGUF = f"{MODELS}/{GGUF.name}"
B70CTL = "/opt/b70/bin/b70ctl"
PYTHON = "/opt/b70/bin/python"
RUNTIMES = ("llamacpp-a", "llamacpp-b")
UNITS = {name: f"b70-{name}.service" for name in RUNTIMES}
PROXY = "b70-litellm.service"
MONITOR = "b70-monitor.service"
COLLEAGUE = "colleague"


def native_runtime(name: str, parallel: int) -> str:
    """A llama.cpp runtime as the README installs one, on the CPU, serving the owner's GGUF."""
    return f"""
[runtimes.{name}]
engine = "llamacpp"
launcher = "native"
user = "b70"
command = ["/opt/llama.cpp/bin/llama-server"]
model = "{BOX_GGUF}"
start_timeout_s = 120
args = ["-c", "2048", "--parallel", "{parallel}", "--threads", "1"]
"""


# examples/b70.toml's shape on CPU: two llama.cpp runtimes take turns under one name on :8000.
CONFIG = f"""\
default_runtime = "llamacpp-a"
b70ctl = "{B70CTL}"

[proxy]
host = "0.0.0.0"
port = 8000
tls = true
model = "smollm2"
aliases = ["default"]
hold_s = 120

[backend]
host = "127.0.0.1"
port = 8001

{native_runtime("llamacpp-a", 2)}
{native_runtime("llamacpp-b", 4)}"""

# Clients inside the box: N threads of OpenAI-SDK streams through :8000 until the stop file
# exists; every request with its times (the box's clock is the host's), and every HTTP attempt
# (the SDK's retries send a request again).
CLIENTS = """\
import json, os, sys, threading, time
import httpx, openai

n, retries, out, stop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
key = open("/etc/b70/proxy.env").read().split("=", 1)[1].strip()
lock = threading.Lock()
requests, attempts = [], [0]

def attempt(request):
    with lock:
        attempts[0] += 1

def loop(i):
    client = openai.OpenAI(
        base_url="http://127.0.0.1:8000/v1", api_key=key, max_retries=retries, timeout=300,
        http_client=httpx.Client(event_hooks={"request": [attempt]}, timeout=300),
    )
    while not os.path.exists(stop):
        sent, chunks, finish, error = time.time(), 0, None, None
        try:
            stream = client.chat.completions.create(
                model="smollm2", stream=True, max_tokens=24, temperature=0,
                messages=[{"role": "user", "content": f"Tell me about the sea, {i}."}],
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices:
                    chunks += 1
                    finish = chunk.choices[0].finish_reason or finish
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:300]
        with lock:
            requests.append({"client": i, "sent": sent, "ended": time.time(),
                             "chunks": chunks, "finish": finish, "error": error})

threads = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with open(out + ".part", "w") as f:
    json.dump({"requests": requests, "attempts": attempts[0]}, f)
os.rename(out + ".part", out)
"""


@contextmanager
def readme_box(config: str, binds: dict[Path, str] | None = None) -> Iterator[boxkit.Box]:
    """A booted box with the appliance installed the README's way and `config` as
    /etc/b70/appliance.toml, not yet `b70ctl install`ed. `binds`: more host paths, read-only."""
    missing = [str(p) for p in (LLAMA_SERVER, GGUF) if not p.exists()]
    assert not missing, f"missing {missing}: run scripts/fetch-llama-server, scripts/fetch-model"
    fetched = boxkit.fetch()
    with tempfile.TemporaryDirectory(prefix="box-wheel-") as tmp:
        wheel = boxkit.appliance_wheel(fetched.wheels, Path(tmp))
        binds = {
            fetched.wheels: "/wheels",
            wheel: "/wheels-app",
            # The directory of the real binary: its shared libraries are beside it.
            LLAMA_SERVER.resolve().parent: "/opt/llama.cpp/bin",
            GGUF.parent: "/mnt/models",
            **(binds or {}),
        }
        # A B70 host's root has CAP_PERFMON (the runtimes' units pass it on); systemd-nspawn
        # leaves it out of a box's capabilities unless asked.
        # The tree whose /opt/b70 has the locked dependencies, installed there by this same
        # command once per lock (scripts/fetch-box): here it installs the appliance's own wheel,
        # built from the checkout as it is.
        with boxkit.booted_box(fetched.ready, binds, capabilities=("CAP_PERFMON",)) as b:
            b.run(
                "python3 -m venv /opt/b70 && /opt/b70/bin/pip install --quiet --no-index "
                "--find-links /wheels --find-links /wheels-app b70-appliance",
                timeout=900,
            )
            b.run(f"mkdir -p /etc/b70 {MODELS} && cp /mnt/models/{GGUF.name} {MODELS}/")
            b.write("/etc/b70/appliance.toml", config)
            b.write("/root/clients.py", CLIENTS)
            yield b


@pytest.fixture(scope="module")
def box() -> Iterator[boxkit.Box]:
    with readme_box(CONFIG) as b:
        yield b


@pytest.fixture(scope="module")
def installed(box: boxkit.Box) -> boxkit.Box:
    # CPU runtimes in a box with no B70: doctor, which install runs first on the system
    # manager, would stop at the cards.
    out = b70ctl(box, "install", "--no-doctor", timeout=600)
    print(f"\nb70ctl install:\n{out.stdout}{out.stderr}")
    assert out.returncode == 0, out.stdout + out.stderr
    return box


def b70ctl(
    box: boxkit.Box, *args: str, user: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return box.run(shlex.join([B70CTL, *args]), user=user, check=False, timeout=timeout)


def key(box: boxkit.Box) -> str:
    return box.read("/etc/b70/proxy.env").split("=", 1)[1].strip()


def complete(box: boxkit.Box, timeout_s: float = 120) -> str:
    """One chat completion through :8000 with the appliance's key; its reply."""
    body = json.dumps(
        {
            "model": "smollm2",
            "max_tokens": 12,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
    )
    cmd = (
        f"curl -sS --fail-with-body -m {timeout_s:g} http://127.0.0.1:8000/v1/chat/completions "
        f"-H 'Authorization: Bearer {key(box)}' -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}"
    )
    out = box.run(cmd, timeout=timeout_s + 10)
    content: str = json.loads(out.stdout)["choices"][0]["message"]["content"]
    return content


def serving(box: boxkit.Box) -> str:
    data = json.loads(b70ctl(box, "status", "--json").stdout)
    active: str = data["result"]["active_runtime"]
    return active


def status_of(box: boxkit.Box, pid: int) -> dict[str, str]:
    lines = box.read(f"/proc/{pid}/status").splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


class Clients:
    """CLIENTS running inside the box as a transient unit of its own, until `stop()`."""

    def __init__(self, box: boxkit.Box, n: int, retries: int) -> None:
        name = f"box-clients-{time.time_ns()}"
        self.box, self.unit = box, name
        self.out, self.stop_file = f"/root/{name}.json", f"/root/{name}.stop"
        box.run(
            f"systemd-run --quiet --unit={name} --collect {PYTHON} /root/clients.py "
            f"{n} {retries} {self.out} {self.stop_file}"
        )

    def stop(self, timeout_s: float = 300) -> dict[str, Any]:
        self.box.run(f"touch {self.stop_file}")
        deadline = time.monotonic() + timeout_s
        while not self.box.exists(self.out):
            if time.monotonic() > deadline:
                journal = self.box.journal(self.unit)
                self.box.run(f"systemctl kill -s KILL {self.unit}", check=False)
                raise AssertionError(f"the clients did not finish:\n{journal}")
            time.sleep(0.5)
        data: dict[str, Any] = json.loads(self.box.read(self.out))
        return data

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.box.exists(self.out):  # a failed test: stop them, and do not wait long
            self.box.run(f"touch {self.stop_file}", check=False)
            time.sleep(5)
            self.box.run(f"systemctl kill -s KILL {self.unit}", check=False)


def judged(requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"succeeded": [], "failed": [], "truncated": []}
    for r in requests:
        if r["error"] is None and r["finish"] is not None:
            out["succeeded"].append(r)
        elif r["chunks"]:
            out["truncated"].append(r)
        else:
            out["failed"].append(r)
    return out


def unit_show(box: boxkit.Box, unit: str, *names: str) -> dict[str, str]:
    argv = ["systemctl", "show", unit] + [f"--property={n}" for n in names]
    lines = box.run(shlex.join(argv)).stdout.splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def mount_options(mounts: dict[str, list[str]], path: str) -> list[str]:
    """The options of the mount that holds `path` (the longest mount point above it)."""
    holders = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    return mounts[max(holders, key=len)]


def box_now(box: boxkit.Box) -> float:
    return float(box.run("date +%s.%N").stdout)


# --- the tests, in order -------------------------------------------------------------------------


def test_doctor_on_a_cpu_box_fails_only_for_the_missing_card(box: boxkit.Box) -> None:
    """No B70 here: doctor exits 1 and names exactly that, with its fix; the runtimes' binary
    (its shared libraries) and the owner's models in /srv/b70/models pass."""
    plain = b70ctl(box, "doctor")
    print(f"\nb70ctl doctor (exit {plain.returncode}):\n{plain.stdout}{plain.stderr}")
    out = b70ctl(box, "doctor", "--json")
    doc = json.loads(out.stdout)
    checks = (
        doc.get("result", {}).get("checks") or doc.get("error", {}).get("details", {})["checks"]
    )
    failed = {c["name"] for c in checks if not c["ok"]}
    passed = {c["name"] for c in checks if c["ok"]}
    assert plain.returncode == 1 and failed == {"cards"}, checks
    assert all(c["fix"] for c in checks if not c["ok"]), checks
    for name in RUNTIMES:
        assert {f"{name}: libraries", f"{name}: model"} <= passed, checks
    models = [c["detail"] for c in checks if c["name"].endswith(": model")]
    assert all(d.startswith(BOX_GGUF + ":") for d in models), models


def test_install_serves_a_completion_through_8000_with_the_key(installed: boxkit.Box) -> None:
    box = installed
    assert box.read("/etc/b70/proxy.env").startswith("LITELLM_MASTER_KEY=")
    assert box.run("stat -c %a /etc/b70/proxy.env").stdout.strip() == "600"
    reply = complete(box)
    print(f"\ncompletion through :8000: {reply!r}")
    assert reply.strip()
    refused = box.run(
        "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/v1/chat/completions "
        '-H \'Content-Type: application/json\' -d \'{"model": "smollm2", "messages": []}\''
    ).stdout
    assert refused == "401"
    assert serving(box) == "llamacpp-a"


# Bits of CapEff (linux/capability.h)
CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_PERFMON = 2, 19, 38


def test_each_unit_runs_in_its_sandbox(installed: boxkit.Box) -> None:
    """Read from the running processes: the user, the capabilities in effect, no new privileges,
    the seccomp filter, and in the process's own mount namespace a read-only /usr and /etc and
    a /root that hides what is in it."""
    box = installed
    box.run("touch /root/b70-marker")
    expected = {
        UNITS[serving(box)]: ("b70", 1 << CAP_PERFMON),
        PROXY: ("b70-proxy", 0),
        MONITOR: ("root", 1 << CAP_SYS_PTRACE | 1 << CAP_DAC_READ_SEARCH | 1 << CAP_PERFMON),
    }
    seen = {}
    for unit, (user, caps) in expected.items():
        pid = box.main_pid(unit)
        st = status_of(box, pid)
        uid = box.run(f"id -u {user}").stdout.strip()
        mounts = {
            line.split()[4]: line.split()[5].split(",")
            for line in box.read(f"/proc/{pid}/mountinfo").splitlines()
        }
        enter = f"nsenter -t {pid} -m --"
        writes = {
            d: box.run(f"{enter} touch {d}/.b70-probe", check=False).stderr.strip()
            for d in ("/usr", "/etc")
        }
        home = box.run(f"{enter} ls -A /root", check=False)
        seen[unit] = {
            "Uid": st["Uid"],
            "CapEff": st["CapEff"],
            "NoNewPrivs": st["NoNewPrivs"],
            "Seccomp": st["Seccomp"],
            "/usr": mount_options(mounts, "/usr"),
            "writes": writes,
            "/root": home.stdout.split(),
        }
        print(f"\n{unit} (pid {pid}): {seen[unit]}")
        assert st["Uid"].split() == [uid] * 4, (unit, st["Uid"])
        assert int(st["CapEff"], 16) == caps, (unit, st["CapEff"], hex(caps))
        assert st["NoNewPrivs"] == "1", unit
        assert st["Seccomp"] == "2", unit  # a filter
        assert "ro" in mount_options(mounts, "/usr"), (unit, mount_options(mounts, "/usr"))
        assert all("Read-only file system" in why for why in writes.values()), (unit, writes)
        assert "b70-marker" not in home.stdout, (unit, home.stdout)
    box.run("rm -f /root/b70-marker")


def test_the_status_page_answers_on_loopback(installed: boxkit.Box) -> None:
    box = installed
    deadline = time.monotonic() + 60
    while True:
        page = box.run("curl -sS --fail-with-body -m 10 http://127.0.0.1:9101/", check=False)
        if page.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert page.returncode == 0, page.stdout + page.stderr
    assert "<title>b70 appliance</title>" in page.stdout
    metrics = box.run("curl -sS --fail-with-body -m 10 http://127.0.0.1:9101/metrics").stdout
    assert "b70_" in metrics


def test_a_switch_both_ways_under_load_fails_no_request(installed: boxkit.Box) -> None:
    """Four OpenAI-SDK stream loops (no retries) while the runtime is switched to llamacpp-b and
    back: every request is answered whole."""
    box = installed
    assert serving(box) == "llamacpp-a"
    switches = []
    with Clients(box, 4, retries=0) as clients:
        time.sleep(3)
        for target in ("llamacpp-b", "llamacpp-a"):
            start = box_now(box)
            out = b70ctl(box, "switch", target, "--json")
            switches.append((target, start, box_now(box), out))
            time.sleep(2)
        data = clients.stop()
    results = judged(data["requests"])
    during = [
        r
        for r in data["requests"]
        if any(r["sent"] < end and r["ended"] > start for _, start, end, _ in switches)
    ]
    print(
        f"\nswitches under load: {len(data['requests'])} requests, "
        + ", ".join(f"{k} {len(v)}" for k, v in results.items())
        + f"; {len(during)} overlapped a switch; "
        + "; ".join(
            f"to {t} {end - start:.1f} s exit {o.returncode}" for t, start, end, o in switches
        )
    )
    for target, _, _, out in switches:
        assert out.returncode == 0, (target, out.stdout, out.stderr)
    assert results["failed"] == [] and results["truncated"] == [], results
    assert len(during) >= 4
    assert serving(box) == "llamacpp-a"


def test_a_runtime_killed_is_restarted_and_serves_again(installed: boxkit.Box) -> None:
    box = installed
    unit = UNITS[serving(box)]
    pid = box.main_pid(unit)
    restarts = box.run(f"systemctl show -p NRestarts --value {unit}").stdout.strip()
    box.run(f"kill -9 {pid}")
    deadline = time.monotonic() + 180
    while True:
        props = unit_show(box, unit, "ActiveState", "MainPID")
        if props["ActiveState"] == "active" and int(props["MainPID"]) not in (0, pid):
            break
        assert time.monotonic() < deadline, (props, box.journal(unit))
        time.sleep(0.5)
    reply = complete(box)
    after = box.run(f"systemctl show -p NRestarts --value {unit}").stdout.strip()
    monitor = box.journal(MONITOR, 20)
    print(
        f"\n{unit}: kill -9 of {pid}; serving again as {props['MainPID']}, NRestarts {restarts} -> "
        f"{after}; reply {reply!r}\nthe monitor's journal:\n{monitor}"
    )
    assert reply.strip()


def test_a_switch_killed_while_loading_is_recovered_by_the_next(installed: boxkit.Box) -> None:
    """SIGKILL of `b70ctl switch` once its new runtime is starting; the next switch records it
    as interrupted, and serves."""
    box = installed
    before = serving(box)
    target = next(n for n in RUNTIMES if n != before)
    box.run(
        f"systemd-run --quiet --unit=box-switch --collect -p StandardOutput=file:/root/switch.out "
        f"-p StandardError=file:/root/switch.err {B70CTL} switch {target}"
    )
    # Its loading phase: the unit is starting and llama-server runs (its health guard waits).
    deadline = time.monotonic() + 120
    while True:
        props = unit_show(box, UNITS[target], "ActiveState", "SubState", "MainPID")
        if props["ActiveState"] == "activating" and int(props["MainPID"]) > 1:
            break
        if props["ActiveState"] == "active":  # it loaded faster than it was looked at
            break
        assert time.monotonic() < deadline, (props, box.read("/root/switch.err"))
        time.sleep(0.02)
    box.run("systemctl kill -s KILL box-switch")
    print(f"\nkilled the switch with {UNITS[target]} {props}")
    killed_log = box.read("/root/switch.err")
    after = b70ctl(box, "switch", target, "--json", timeout=600)
    history = [json.loads(line) for line in box.read("/var/lib/b70/switches.jsonl").splitlines()]
    interrupted = [h for h in history if h.get("interrupted")]
    print(
        f"\nthe killed switch's output:\n{killed_log}\nthe next switch (exit {after.returncode}):"
        f"\n{after.stdout}{after.stderr}\ninterrupted records: {interrupted}"
    )
    assert after.returncode == 0, after.stdout + after.stderr
    assert interrupted and interrupted[-1]["to"] == target, history[-3:]
    assert serving(box) == target
    data = json.loads(b70ctl(box, "status", "--json").stdout)["result"]
    assert data["killed_switch"] is None and data["hold"]["switching_to"] is None, data
    enabled = {u["unit"]: u["enabled"] for u in data["units"]}
    assert enabled[UNITS[target]] == "enabled", enabled
    assert complete(box).strip()


def test_the_proxy_killed_under_load_loses_no_request(installed: boxkit.Box) -> None:
    """SIGKILL of the proxy's main process while four clients stream (with the OpenAI SDK's
    default two retries): systemd restarts it behind its socket, and no request fails."""
    box = installed
    with Clients(box, 4, retries=2) as clients:
        time.sleep(3)
        pid = box.main_pid(PROXY)
        killed_at = box_now(box)
        box.run(f"kill -9 {pid}")
        deadline = time.monotonic() + 120
        while box.main_pid(PROXY) == pid:
            assert time.monotonic() < deadline, box.journal(PROXY)
            time.sleep(0.5)
        time.sleep(8)
        data = clients.stop()
    results = judged(data["requests"])
    after = [r for r in data["requests"] if r["sent"] > killed_at and r["error"] is None]
    first = min((r["ended"] for r in after), default=None)
    print(
        f"\nproxy SIGKILL under load: {len(data['requests'])} requests, "
        + ", ".join(f"{k} {len(v)}" for k, v in results.items())
        + f"; {data['attempts'] - len(data['requests'])} sent again by the SDK; first answer to "
        f"a request sent after the kill {first - killed_at if first else float('nan'):.1f} s after it"
    )
    for r in results["failed"] + results["truncated"]:
        print(f"  sent {r['sent'] - killed_at:+.2f} s after the kill: {r['error']}")
    assert results["failed"] == [] and results["truncated"] == [], results
    assert after, "no request sent after the kill was answered"


def colleague(box: boxkit.Box) -> str:
    """An account that is not root and in no b70 group."""
    if box.run(f"id {COLLEAGUE}", check=False).returncode != 0:
        box.run(f"useradd -m {COLLEAGUE}")
    return COLLEAGUE


def test_a_colleague_reads_status_and_writes_nothing(installed: boxkit.Box) -> None:
    """`status` and `status --json` work for another account, see what root sees, and write
    nothing anywhere (no file of that account is newer than the commands)."""
    box = installed
    user = colleague(box)
    box.run("touch /run/b70-stamp && sleep 1.1")
    plain = b70ctl(box, "status", user=user)
    as_json = b70ctl(box, "status", "--json", user=user)
    written = box.run(
        "find / \\( -path /proc -o -path /sys \\) -prune -o "
        f"-user {user} -newer /run/b70-stamp -print"
    ).stdout.split()
    print(
        f"\nas {user}: status (exit {plain.returncode}):\n{plain.stdout}{plain.stderr}"
        f"\nstatus --json (exit {as_json.returncode}):\n{as_json.stdout}{as_json.stderr}"
        f"\nwritten: {written}"
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["ok"], as_json.stdout
    assert written == []
    theirs = json.loads(as_json.stdout)["result"]
    ours = json.loads(b70ctl(box, "status", "--json").stdout)["result"]
    assert theirs["active_runtime"] == ours["active_runtime"] is not None
    # The appliance's health as root sees it: the runtime, of the b70 user, is not "another
    # user's process" to them.
    for part in ("backend", "proxy"):
        assert theirs[part]["healthy"] == ours[part]["healthy"], (part, theirs[part], ours[part])
    assert theirs["backend"]["foreign_listener"] == ours["backend"]["foreign_listener"]


# Inside the box: the fingerprint of the certificate the port serves (its own handshake), and
# one model list over TLS trusting that certificate alone.
TLS_PROBE = """\
import hashlib, json, socket, ssl, sys
import httpx
trust = ssl.create_default_context(cafile="/var/lib/b70/tls.crt")
with socket.create_connection(("127.0.0.1", 8000)) as raw:
    with trust.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        digest = hashlib.sha256(tls.getpeercert(binary_form=True)).hexdigest().upper()
key = open("/etc/b70/proxy.env").read().split("=", 1)[1].strip()
r = httpx.get("https://127.0.0.1:8000/v1/models", verify=trust,
              headers={"Authorization": "Bearer " + key})
print(json.dumps({"served": ":".join(digest[i:i + 2] for i in range(0, 64, 2)),
                  "status": r.status_code}))
"""


def test_the_proxy_serves_tls_with_a_key_only_its_user_reads(installed: boxkit.Box) -> None:
    """System scope: install made the certificate with its key the proxy's user's alone; the
    port serves it, and a colleague's `status` gives its fingerprint."""
    box = installed
    modes = box.run("stat -c '%U %a %n' /var/lib/b70/tls.key /var/lib/b70/tls.crt").stdout
    assert modes.split("\n")[:2] == [
        "b70-proxy 600 /var/lib/b70/tls.key", "b70-proxy 644 /var/lib/b70/tls.crt"
    ], modes  # fmt: skip
    probe = box.run(f"{PYTHON} -c {shlex.quote(TLS_PROBE)}", timeout=60)
    got = json.loads(probe.stdout)
    assert got["status"] == 200, got
    theirs = json.loads(b70ctl(box, "status", "--json", user=colleague(box)).stdout)
    assert theirs["result"]["proxy"]["tls"]["fingerprint"] == got["served"], theirs["result"]
    assert complete(box)  # loopback stays plain HTTP


def test_a_colleague_is_refused_a_switch_and_told_who_may(installed: boxkit.Box) -> None:
    box = installed
    user = colleague(box)
    before = serving(box)
    target = next(n for n in RUNTIMES if n != before)
    switch = b70ctl(box, "switch", target, user=user)
    as_json = b70ctl(box, "switch", target, "--json", user=user)
    print(
        f"\nas {user}: switch {target} (exit {switch.returncode}):\n{switch.stdout}{switch.stderr}"
        f"\nswitch --json (exit {as_json.returncode}):\n{as_json.stdout}{as_json.stderr}"
    )
    said = switch.stdout + switch.stderr
    assert switch.returncode != 0
    assert "Permission denied" not in said and "Errno" not in said, said
    assert "root" in said, said  # who may
    error = json.loads(as_json.stdout)["error"]
    assert "root" in error["message"] and "Permission denied" not in error["message"], error
    assert serving(box) == before


def test_a_colleague_runs_every_command_that_only_reads(installed: boxkit.Box) -> None:
    """gpu, plan, doctor and bench (with a key the colleague was given) work for an account
    that is not root and write nothing; logs names the group to join, and works once joined."""
    box = installed
    user = colleague(box)
    box.write(
        "/tmp/config.json", (REPO / "tests" / "fixtures" / "hybrid-moe-config.json").read_text()
    )
    box.run("chmod 644 /tmp/config.json && touch /run/b70-stamp-2 && sleep 1.1")
    outs = {
        "gpu": b70ctl(box, "gpu", "--json", user=user),
        "plan": b70ctl(box, "plan", "/tmp/config.json", "--json", user=user),
        "doctor": b70ctl(box, "doctor", "--json", user=user),
        "bench": box.run(
            f"cd /tmp && B70_API_KEY={shlex.quote(key(box))} {B70CTL} bench --requests 2 "
            "--concurrency 1 --input-tokens 16 --output-tokens 8 --json --out /tmp/theirs.json",
            user=user, check=False, timeout=300,
        ),
    }  # fmt: skip
    for name, out in outs.items():
        print(
            f"\nas {user}: {name} (exit {out.returncode}):\n{out.stdout[-1500:]}{out.stderr[-800:]}"
        )
    assert outs["gpu"].returncode == 0 and json.loads(outs["gpu"].stdout)["ok"]
    assert outs["plan"].returncode == 0 and json.loads(outs["plan"].stdout)["ok"]
    assert outs["bench"].returncode == 0, outs["bench"].stderr
    # doctor fails only where it does for root: no B70 in this box; the models open as b70.
    failed = {c["name"] for c in json.loads(outs["doctor"].stdout)["error"]["details"]["checks"]
              if not c["ok"]}  # fmt: skip
    assert failed == {"cards"}, failed
    written = box.run(
        "find / \\( -path /proc -o -path /sys \\) -prune -o "
        f"-user {user} -newer /run/b70-stamp-2 -print"
    ).stdout.split()
    assert written == ["/tmp/theirs.json"], "bench's own result file, where it was asked, alone"
    logs = b70ctl(box, "logs", RUNTIMES[0], "-n", "5", user=user)
    assert logs.returncode == 1 and "usermod -aG systemd-journal" in logs.stderr, logs.stderr
    box.run(f"usermod -aG systemd-journal {user}")
    logs = b70ctl(box, "logs", "proxy", "-n", "5", user=user)
    assert logs.returncode == 0 and "No journal files" not in logs.stdout + logs.stderr, logs
    assert logs.stdout.strip()


def test_an_operator_switches_with_the_sudo_line_of_the_docs(installed: boxkit.Box) -> None:
    """docs/security.md's way to let a group switch: one sudoers line, for that one command."""
    box = installed
    user = colleague(box)
    box.run(f"groupadd -f b70-operators && usermod -aG b70-operators {user}")
    line = f"%b70-operators ALL=(root) NOPASSWD: {B70CTL} switch *\n"
    box.write("/etc/sudoers.d/b70", line, mode="0440")
    box.run("visudo -cf /etc/sudoers.d/b70")
    try:
        before = serving(box)
        target = next(n for n in RUNTIMES if n != before)
        out = box.run(f"sudo -n {B70CTL} switch {target}", user=user, check=False, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert serving(box) == target
        other = box.run(f"sudo -n {B70CTL} uninstall", user=user, check=False)
        assert other.returncode != 0 and serving(box) == target, "the line grants switch alone"
    finally:
        box.run("rm -f /etc/sudoers.d/b70")


def test_a_hung_runtime_is_restarted_by_the_monitor(installed: boxkit.Box) -> None:
    """SIGSTOP: systemd sees a running process; the monitor, root with its capabilities cut,
    sees no answer and restarts the unit over the system manager."""
    box = installed
    unit = UNITS[serving(box)]
    pid = box.main_pid(unit)
    box.run(f"kill -STOP {pid}")
    deadline = time.monotonic() + 240
    try:
        while (
            box.main_pid(unit) in (0, pid)
            or unit_show(box, unit, "ActiveState")["ActiveState"] != "active"
        ):
            assert time.monotonic() < deadline, box.journal(MONITOR, 30)
            time.sleep(1)
    finally:
        box.run(f"kill -CONT {pid}", check=False)
    said = box.journal(MONITOR, 40)
    print(f"\nthe monitor's journal:\n{said}")
    assert f"restart {unit.removeprefix('b70-').removesuffix('.service')}" in said
    monitor = json.loads(b70ctl(box, "status", "--json").stdout)["result"]["monitor"]
    assert monitor["restarts_by_monitor"] >= 1, monitor
    assert complete(box).strip()


def test_uninstall_purge_leaves_nothing_but_the_owners_models(installed: boxkit.Box) -> None:
    box = installed
    digest = box.run(f"sha256sum {BOX_GGUF}").stdout.split()[0]
    out = b70ctl(box, "uninstall", "--purge", timeout=300)
    print(f"\nb70ctl uninstall --purge (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    left = {
        "units": box.run(
            "find /etc/systemd/system /run/systemd/system -name 'b70*'", check=False
        ).stdout.split(),
        "loaded": box.run("systemctl list-units --all --no-legend --plain 'b70*'").stdout.split(
            "\n"
        ),
        # What install wrote beside the owner's appliance.toml (which stays)
        "config files": box.run(
            "ls -d /etc/b70/proxy.env /etc/b70/litellm.yaml /etc/sysusers.d/b70.conf 2>/dev/null",
            check=False,
        ).stdout.split(),
        "state": box.run("find /var/lib/b70 -mindepth 1 2>/dev/null", check=False).stdout.split(),
        "caches": box.run("ls -d /var/cache/b70* 2>/dev/null", check=False).stdout.split(),
        "processes": box.run("pgrep -a -u b70,b70-proxy", check=False).stdout.split("\n"),
    }
    left = {k: [x for x in v if x.strip()] for k, v in left.items()}
    also = box.run("ls -la /etc/b70; getent passwd b70 b70-proxy", check=False)
    print(f"left behind: {left}\nbeside it:\n{also.stdout}{also.stderr}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert all(v == [] for v in left.values()), left
    assert box.run(f"sha256sum {BOX_GGUF}", check=False).stdout.split()[:1] == [digest]
    refused = box.run("curl -s -m 5 http://127.0.0.1:8000/health", check=False)
    assert refused.returncode != 0  # nothing listens on :8000 any more
