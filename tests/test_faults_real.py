"""Faults on the real stack: a switch interrupted (SIGINT, SIGTERM) or killed (SIGKILL) in each of
its phases, and a runtime that cannot start. Each ends with the appliance serving, no request
held, `status` saying what happened, and the next switch working."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import B70CTL, GGUF, LLAMA_SERVER, Appliance, live_pid
from tests.test_switch_real import long_stream, start_switch

# How long the appliance may take to serve again after a killed switch (the next command
# recovers it; a llama-server restart takes a few seconds here).
RECOVERY_S = 90


def state_dir(app: Appliance) -> Path:
    return Path(app.manager.env["XDG_STATE_HOME"]) / "b70"


def main_pid(app: Appliance, unit: str) -> int:
    return int(app.manager.systemctl("show", "-p", "MainPID", "--value", unit).strip() or 0)


def monitor_log(app: Appliance) -> str:
    out = app.b70ctl("logs", "monitor", "-n", "40")
    return out.stdout + out.stderr


def lock_info(app: Appliance) -> dict[str, Any]:
    """The running switch's note: who, to what, how far (an empty dict when none runs)."""
    try:
        data = json.loads((state_dir(app) / "switch.json").read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def wait_for_phase(app: Appliance, switch: subprocess.Popen[str], phase: str) -> bool:
    """Until the running switch reaches `phase` ("hold": the hold mark is written)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and switch.poll() is None:
        if phase == "hold":
            if (state_dir(app) / "hold.json").exists():
                return True
        elif lock_info(app).get("phase") == phase:
            return True
        time.sleep(0.003)
    return False


def serving_again(app: Appliance) -> dict[str, Any]:
    """Status (the next command, which recovers a killed switch) until llama.cpp serves."""
    deadline = time.monotonic() + RECOVERY_S
    while True:
        status = app.json("status")["result"]
        if status["active_runtime"] == "llamacpp" and status["killed_switch"] is None:
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.5)


def interrupt_at(
    app: Appliance, phase: str, sig: signal.Signals
) -> tuple[subprocess.CompletedProcess[str], int]:
    """`b70ctl switch llamacpp --restart` hit by `sig` in `phase`; the old main pid.

    A phase can be over before the signal lands (verify takes a fraction of a second): then the
    run is repeated, up to three times.
    """
    for _ in range(3):
        app.b70ctl("switch", "llamacpp", check=True)
        before = main_pid(app, "b70-llamacpp.service")
        # The hold and the drain pass in milliseconds when nothing is in flight: a stream in
        # flight keeps the switch there long enough to be signalled before its start.
        stream = long_stream(app, max_tokens=200) if phase in {"hold", "drain"} else None
        switch = start_switch(app, "llamacpp", "--restart")
        caught = wait_for_phase(app, switch, phase)
        if caught:
            switch.send_signal(sig)
        out, err = switch.communicate(timeout=600)
        if stream is not None:
            for _ in stream:
                pass
        if caught:
            return subprocess.CompletedProcess(switch.args, switch.returncode, out, err), before
    pytest.fail(f"the switch never stayed in phase {phase} long enough to be signalled")


PHASES = ["hold", "drain", "start", "verify"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_switch_finishes_its_step_and_says_so(
    appliance: Appliance, phase: str, sig: signal.Signals
) -> None:
    if sig is signal.SIGTERM and phase in {"hold", "verify"}:
        pytest.skip("SIGTERM takes the same path as SIGINT; two phases of it are enough")
    out, before = interrupt_at(appliance, phase, sig)
    assert out.returncode == 130, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] is False and doc["error"]["code"] == "interrupted"
    message = doc["error"]["message"]
    assert "Traceback" not in out.stderr
    status = appliance.json("status")["result"]
    last = status["last_switch"]
    assert last["interrupted"] is True and last["to"] == "llamacpp"
    after = main_pid(appliance, "b70-llamacpp.service")
    if phase in {"hold", "drain"}:
        # Before the start: nothing changed, the old runtime serves on.
        assert f"interrupted by {sig.name} during" in message and "nothing was changed" in message
        assert last["ok"] is False
        assert after == before
    else:
        # After the start: the old runtime was already stopping, so the switch was finished.
        assert "the switch was finished: llamacpp is serving" in message, message
        assert last["ok"] is True
        assert after != before
    assert status["active_runtime"] == "llamacpp" and status["hold"]["switching_to"] is None
    assert not (state_dir(appliance) / "hold.json").exists()
    assert appliance.ask().strip()
    assert appliance.json("switch", "llamacpp", "--restart")["ok"]


@pytest.mark.parametrize("phase", PHASES)
def test_a_killed_switch_is_found_recorded_and_recovered(appliance: Appliance, phase: str) -> None:
    out, _ = interrupt_at(appliance, phase, signal.SIGKILL)
    assert out.returncode == -signal.SIGKILL
    status = serving_again(appliance)
    last = status["last_switch"]
    assert last["interrupted"] is True and last["ok"] is False, last
    assert "was killed during" in last["error"], last
    assert status["hold"]["switching_to"] is None
    assert not (state_dir(appliance) / "hold.json").exists()
    assert lock_info(appliance) == {}, "the killed switch's trace was not cleared"
    assert not (state_dir(appliance) / "killed-switch.json").exists()
    enabled = {u["unit"]: u["enabled"] for u in status["units"]}
    assert enabled["b70-llamacpp.service"] == "enabled"
    assert appliance.ask().strip()
    assert appliance.json("switch", "llamacpp", "--restart")["ok"]


def test_a_killed_switch_to_another_runtime_leaves_boot_and_serving_agreeing(
    appliance: Appliance,
) -> None:
    """Killed once the new runtime is starting: systemd finishes the start; the next command
    makes the runtime that serves the one enabled at boot."""
    appliance.b70ctl("switch", "llamacpp", check=True)
    switch = start_switch(appliance, "vllm")
    assert wait_for_phase(appliance, switch, "start")
    deadline = time.monotonic() + 60  # the phase is noted just before the StartUnit is sent
    while appliance.manager.systemctl(
        "show", "-p", "ActiveState", "--value", "b70-vllm"
    ).strip() != ("activating"):
        assert time.monotonic() < deadline, "the switch never started vLLM"
        time.sleep(0.02)
    switch.send_signal(signal.SIGKILL)
    switch.communicate(timeout=60)
    # vLLM takes about half a minute to load: the first status finds systemd still at it.
    first = appliance.json("status")["result"]
    assert first["killed_switch"] is not None and first["killed_switch"]["target"] == "vllm"
    deadline = time.monotonic() + 600
    while True:  # recovered, and settled: one runtime serves
        status = appliance.json("status")["result"]
        if status["killed_switch"] is None and status["active_runtime"] is not None:
            break
        assert time.monotonic() < deadline, status
        time.sleep(1)
    serving = status["active_runtime"]
    enabled = {u["unit"]: u["enabled"] for u in status["units"]}
    # The runtime that serves is the one enabled at boot, and no other runtime is.
    assert enabled["b70-vllm.service"] == ("enabled" if serving == "vllm" else "disabled")
    assert enabled["b70-llamacpp.service"] == ("enabled" if serving == "llamacpp" else "disabled")
    assert enabled["b70-broken.service"] == enabled["b70-llamacpp-b.service"] == "disabled"
    assert {
        enabled[u] for u in ("b70-litellm.socket", "b70-litellm.service", "b70-monitor.service")
    } == {"enabled"}
    error = status["last_switch"]["error"]
    assert "was killed during" in error, error
    if serving != "vllm":  # vLLM did not finish its start: the boot runtime was started instead
        print(
            "vLLM did not come up after the kill:", error, appliance.b70ctl("logs", "vllm").stdout
        )
        assert "started llamacpp, the runtime enabled at boot" in error, error
    else:
        assert "vllm is serving; it is now the runtime enabled at boot" in error, error
    assert appliance.ask().strip()
    assert appliance.json("switch", "llamacpp")["ok"]


def test_a_runtime_flag_it_does_not_know_rolls_back(appliance: Appliance, tmp_path: Path) -> None:
    appliance.b70ctl("switch", "llamacpp", check=True)
    config = tmp_path / "appliance.toml"
    text = appliance.config.read_text().replace(
        "[runtimes.broken]",
        f'[runtimes.badflag]\nengine = "llamacpp"\ncommand = ["{LLAMA_SERVER}"]\n'
        f'model = "{GGUF}"\nargs = ["--no-such-flag"]\n\n[runtimes.broken]',
    )
    config.write_text(text)

    def b70ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [B70CTL, "--user", "--config", str(config), *args],
            env=appliance.manager.env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    installed = b70ctl("install")
    assert installed.returncode == 0, installed.stderr
    try:
        out = b70ctl("switch", "badflag")
        assert out.returncode == 1
        assert "switch to badflag failed" in out.stderr
        assert "rolled back: llamacpp is serving again" in out.stderr
        assert "no-such-flag" in out.stderr  # the journal excerpt names the flag
        assert appliance.ask().strip()
    finally:
        # Back to the appliance's own config, as the other tests expect it.
        appliance.b70ctl("install", check=True)


class Clients:
    """Threads of OpenAI-SDK clients sending short chat requests without retries, so what a
    request meets is what it gets: (sent, ended, "ok" or the error) for each."""

    def __init__(self, app: Appliance, n: int, timeout_s: float = 240) -> None:
        import threading

        self.app, self.timeout_s = app, timeout_s
        self.outcomes: list[tuple[float, float, str]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run) for _ in range(n)]

    def run(self) -> None:
        import openai

        c = self.app.client()
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                c.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": "Say yes."}],
                    max_tokens=4,
                    timeout=self.timeout_s,
                )
                self.outcomes.append((sent, time.monotonic(), "ok"))
            except openai.APIError as e:
                self.outcomes.append((sent, time.monotonic(), f"{type(e).__name__}: {e}"))
                time.sleep(0.2)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=self.timeout_s + 60)

    def answered_after(self, at: float, deadline_s: float) -> None:
        """Wait until a request sent after `at` is answered."""
        deadline = at + deadline_s
        while not any(sent > at and kind == "ok" for sent, _, kind in self.outcomes):
            assert time.monotonic() < deadline, f"nothing was answered within {deadline_s} s"
            time.sleep(0.5)

    def failed(self) -> list[tuple[float, str]]:
        return [(sent, kind) for sent, _, kind in self.outcomes if kind != "ok"]


def killed_under_load(app: Appliance, n: int, main_pid: Callable[[], int], what: str) -> int:
    """SIGKILL of the runtime's process `main_pid()` while `n` clients send requests; every
    request answered, and at least one was in flight at the kill. The pid killed."""
    with Clients(app, n) as clients:
        time.sleep(4)
        killed = main_pid()
        assert killed > 1
        killed_at = time.monotonic()
        os.kill(killed, signal.SIGKILL)
        clients.answered_after(killed_at + 1, 180)
        time.sleep(3)
    spanning = [ended - sent for sent, ended, kind in clients.outcomes if sent <= killed_at < ended]
    print(
        f"\n{what} SIGKILL under load: {len(clients.outcomes)} requests, "
        f"{len(clients.failed())} failed; {len(spanning)} were in flight at the kill, answered "
        f"after {', '.join(f'{d:.1f}' for d in spanning)} s"
    )
    assert clients.failed() == []
    assert spanning, "no request was in flight at the kill: the test proved nothing"
    return killed


def test_the_runtime_killed_under_load_loses_no_request(appliance: Appliance) -> None:
    """SIGKILL of llama-server while 6 clients send requests: systemd starts it again. Requests
    it was answering die with it before a byte reached their clients, so the proxy's door holds
    them until it serves again and sends them again; requests sent meanwhile are held."""
    appliance.b70ctl("switch", "llamacpp", check=True)
    killed_under_load(
        appliance, 6, lambda: live_pid(appliance, "b70-llamacpp.service"), "llama-server"
    )
    journal = appliance.b70ctl("logs", "proxy", "-n", "200").stdout
    # Sent again the full way after the fast way failed, or again after the full way failed.
    resent = journal.count("sent again")
    print(f"sent again by the door: {resent}")
    assert resent >= 1, journal[-3000:]


def test_the_proxy_killed_under_load_comes_back(appliance: Appliance) -> None:
    """SIGKILL of the proxy while clients send requests: systemd restarts it, and its socket
    (b70-litellm.socket) stays open meanwhile, so a request sent then waits in the socket's queue
    and is answered. The workers, stopped by systemd, finish what they serve. The one loss: a
    request sent on a connection kept alive from before, just as the dying worker closes it,
    fails at once (HTTP keep-alive's race; the OpenAI SDK's default retries send it again)."""
    appliance.b70ctl("switch", "llamacpp", check=True)
    clients_n = 4
    with Clients(appliance, clients_n) as clients:
        time.sleep(3)
        killed_at = time.monotonic()
        os.kill(live_pid(appliance, "b70-litellm.service"), signal.SIGKILL)
        clients.answered_after(killed_at, 300)
        time.sleep(2)
    outcomes = clients.outcomes
    after = [(sent, ended, kind) for sent, ended, kind in outcomes if sent > killed_at]
    in_flight = [kind for sent, ended, kind in outcomes if sent <= killed_at < ended]
    back_at = min(ended for sent, ended, kind in after if kind == "ok")
    longest = max(ended - sent for sent, ended, kind in after)
    print(
        f"\nproxy SIGKILL under load: first answer to a request sent after the kill "
        f"{back_at - killed_at:.1f} s after it; {len(after)} requests sent after the kill, "
        f"{sum(kind != 'ok' for *_, kind in after)} failed, the longest took {longest:.1f} s; "
        f"in flight at the kill: {in_flight}"
    )
    failed = [(sent - killed_at, kind) for sent, kind in clients.failed() if sent > killed_at]
    for at, kind in failed:
        print(f"sent {at:+.2f} s after the kill: {kind}")
    assert len(failed) <= clients_n, failed
    assert all(at < 3 and kind.startswith("APIConnectionError") for at, kind in failed), failed
    assert all(kind == "ok" for kind in in_flight), in_flight
    assert appliance.json("status")["result"]["proxy"]["healthy"]


def test_a_switch_asked_as_the_proxy_dies_waits_for_systemd_to_bring_it_back(
    appliance: Appliance,
) -> None:
    """The proxy killed, and a switch asked at once: systemd is restarting the proxy, so the
    switch waits for it instead of refusing it as down, then switches and verifies through it."""
    appliance.b70ctl("switch", "llamacpp", check=True)
    os.kill(live_pid(appliance, "b70-litellm.service"), signal.SIGKILL)
    out = appliance.b70ctl("switch", "llamacpp-b")
    assert out.returncode == 0, out.stderr
    assert appliance.manager.systemctl("is-active", "b70-litellm.service").strip() == "active"
    assert appliance.json("status")["result"]["proxy"]["healthy"]
    appliance.b70ctl("switch", "llamacpp", check=True)


# A full file system over DIR ($1) holding what SAVED ($2) held: a 1 MiB tmpfs, then filled.
FILL = """
mount -t tmpfs -o size=1m b70-full "$1"
cp -a "$2/." "$1/"
dd if=/dev/zero of="$1/filler" bs=4096 2>/dev/null || true
"""


def test_a_full_file_system_under_the_state_directory_changes_nothing(
    appliance: Appliance, tmp_path: Path
) -> None:
    """The state directory on a full file system, for b70ctl and in the user manager's own mount
    namespace (where the monitor, restarted, sees it). A switch is refused before it changes
    anything, with an error that names the directory; the appliance keeps serving; `status`
    works, and the monitor says that it cannot save its record and goes on; once there is room,
    the next switch works."""
    import shutil

    appliance.b70ctl("switch", "llamacpp", check=True)
    folder = state_dir(appliance)
    saved = tmp_path / "saved"
    shutil.copytree(folder, saved)
    manager_pid = (appliance.manager.dir / "mgr" / "manager.pid").read_text().strip()
    namespaces = [[], ["nsenter", "-t", manager_pid, "-m"]]  # this one, and the manager's
    mounted: list[list[str]] = []
    try:
        for enter in namespaces:
            subprocess.run([*enter, "sh", "-c", FILL, "sh", str(folder), str(saved)], check=True)
            mounted.append(enter)
        assert (folder / "filler").stat().st_size > 0
        appliance.manager.systemctl("restart", "b70-monitor.service")
        before = sorted(p.name for p in folder.iterdir())
        out = appliance.b70ctl("switch", "llamacpp-b")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "No space left on device" in out.stderr and str(folder) in out.stderr
        assert "nothing was changed" in out.stderr and "Traceback" not in out.stderr
        assert sorted(p.name for p in folder.iterdir()) == before, "a file was left half-written"
        assert appliance.ask().strip()
        status = appliance.json("status")
        assert status["ok"] and status["result"]["active_runtime"] == "llamacpp"
        deadline = time.monotonic() + 60
        while "cannot save the monitor's record" not in (log := monitor_log(appliance)):
            assert time.monotonic() < deadline, f"the monitor never met the full directory:\n{log}"
            time.sleep(1)
        show = appliance.manager.systemctl("show", "-p", "ActiveState,NRestarts", "b70-monitor")
        assert sorted(show.split()) == ["ActiveState=active", "NRestarts=0"], show
        for enter in namespaces:  # room again
            subprocess.run([*enter, "rm", "-f", str(folder / "filler")], check=True)
        out = appliance.b70ctl("switch", "llamacpp-b")
        assert out.returncode == 0, out.stderr
        assert appliance.json("status")["result"]["active_runtime"] == "llamacpp-b"
    finally:
        for enter in reversed(mounted):
            subprocess.run([*enter, "umount", "-l", str(folder)], check=False)
        appliance.manager.systemctl("restart", "b70-monitor.service")
    appliance.b70ctl("switch", "llamacpp", check=True)
