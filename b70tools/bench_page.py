"""Figures for the status page (run through scripts/bench-page).

1. Weight: bytes on the wire for the first load (the page, its script, its first data), as
   Chromium's DevTools counts them (Network.loadingFinished, encodedDataLength).
2. Time until the page shows data: from the navigation to the first data drawn, three loads.
3. The monitor's CPU (user + system of its process, from /proc) over a window with no page open,
   then over a window of the same length with the page open and polling; both in one run.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import psutil

from b70tools.browser import Browser
from b70tools.demo_appliance import demo_appliance
from b70tools.net import free_port

DRAWN = "document.getElementById('age').textContent.startsWith('updated')"


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def main() -> None:
    cache, window = sys.argv[1], float(sys.argv[2])
    port = free_port()
    with demo_appliance(cache, f"\n[monitor]\nport = {port}\n", "b70-bench-page.") as demo:
        env = demo.env
        show = ["systemctl", "--user", "show", "-p", "MainPID", "--value", "b70-monitor.service"]
        pid = int(subprocess.run(show, env=env, capture_output=True, text=True).stdout)
        time.sleep(10)  # the monitor's first samples
        url = f"http://127.0.0.1:{port}/"
        with Browser() as b:
            loads, weights = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                b.goto(url)
                b.wait_for(DRAWN, 30, "the first data drawn")
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
