"""Figures for the status page (run through scripts/bench-page).

1. Weight: bytes on the wire for the first load (the page, its script, the first state), as
   Chromium's DevTools counts them (Network.loadingFinished, encodedDataLength).
2. Time until the page shows data: from the navigation to the first state drawn, three loads.
3. The monitor's CPU (user + system of its process, from /proc) over a window with no page open,
   then over a window of the same length with the page open and polling; both in one run.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from b70tools.browser import Browser
from b70tools.net import free_port

REPO = Path(__file__).resolve().parent.parent
B70CTL = str(Path(sys.executable).parent / "b70ctl")
DRAWN = "document.getElementById('age').textContent.startsWith('updated')"


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def main() -> None:
    cache, window = sys.argv[1], float(sys.argv[2])
    root = Path(tempfile.mkdtemp(prefix="b70-bench-page."))
    env = dict(os.environ, XDG_CONFIG_HOME=str(root / "config"), XDG_STATE_HOME=str(root / "state"))
    manager = [str(REPO / "scripts" / "user-manager")]
    subprocess.run([*manager, "start", str(root / "mgr")], env=env, check=True)
    for line in (root / "mgr" / "env").read_text().splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value
    port = free_port()
    text = (REPO / "examples" / "demo.toml").read_text().replace("~/.cache/b70", cache)
    text = text.replace("port = 8000", f"port = {free_port()}")
    text = text.replace("port = 8001", f"port = {free_port()}")
    config = root / "appliance.toml"
    config.write_text(text + f"\n[monitor]\nport = {port}\n")
    base = [B70CTL, "--user", "--config", str(config)]
    try:
        subprocess.run([*base, "install"], env=env, check=True, capture_output=True)
        show = ["systemctl", "--user", "show", "-p", "MainPID", "--value", "b70-monitor.service"]
        pid = int(subprocess.run(show, env=env, capture_output=True, text=True).stdout)
        time.sleep(10)  # the monitor's first samples
        url = f"http://127.0.0.1:{port}/"
        with Browser() as b:
            loads, weights = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                b.goto(url)
                b.wait_for(DRAWN, 30, "the first state drawn")
                loads.append(time.perf_counter() - t0)
                time.sleep(1)  # the first poll's answer has arrived
                weights.append(b.bytes_received())
            b.goto("about:blank")
            closed0 = cpu_seconds(pid)
            time.sleep(window)
            closed = cpu_seconds(pid) - closed0
            b.goto(url)
            b.wait_for(DRAWN, 30, "the page")
            open0 = cpu_seconds(pid)
            time.sleep(window)
            opened = cpu_seconds(pid) - open0
    finally:
        subprocess.run([*base, "uninstall", "--purge"], env=env, capture_output=True)
        subprocess.run([*manager, "stop", str(root / "mgr")], env=env)
    print(f"first load, bytes on the wire     {statistics.median(weights):.0f} (loads: {weights})")
    ms = [round(x * 1000) for x in loads]
    print(f"until the page shows data         median {statistics.median(ms)} ms (loads: {ms})")
    print(f"monitor CPU, page closed          {closed:.2f} s in {window:g} s "
          f"({100 * closed / window:.2f}% of a core)")  # fmt: skip
    print(
        f"monitor CPU, page open (polling)  {opened:.2f} s in {window:g} s "
        f"({100 * opened / window:.2f}% of a core); open/closed {opened / max(closed, 1e-9):.2f}"
    )


if __name__ == "__main__":
    main()
