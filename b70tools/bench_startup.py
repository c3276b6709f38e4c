"""Start-up costs the controller and the proxy avoid (run through scripts/bench-startup).

Each figure is the median over fresh processes of this venv's Python: the time one import (or
one call) adds to a process that has imported nothing else of ours, measured inside the process
with time.perf_counter() around it. `python -c pass` is the floor of a whole process, printed
for scale. The modules are the ones the code imports late or avoids, each with the module that
says why:
- psutil, and one psutil.net_connections(): appliance.host.processes reads /proc first;
- httpx and http.client: appliance.host.health speaks HTTP with the socket module;
- tempfile (with shutil and random): appliance.hold makes its files with os.open;
- pystemd whole, and pystemd.dbuslib alone: appliance.units.systemd loads the binding alone;
- prometheus_client.parser: appliance.host.runtime_http imports it when metrics are read.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

# name -> code timed inside a fresh process (setup first, untimed)
PROBES: dict[str, tuple[str, str]] = {
    "import psutil": ("", "import psutil"),
    "psutil.net_connections() once": ("import psutil", "psutil.net_connections('tcp')"),
    "import httpx": ("", "import httpx"),
    "import http.client": ("", "import http.client"),
    "import tempfile": ("", "import tempfile"),
    "import pystemd (whole package)": ("", "import pystemd, pystemd.dbuslib"),
    "import pystemd.dbuslib alone": (
        "from appliance.units import systemd",
        "systemd._import_bus_binding()",
    ),
    "import prometheus_client.parser": ("", "import prometheus_client.parser"),
}

TIMER = """
import json, sys, time
exec(sys.argv[1])
t0 = time.perf_counter()
exec(sys.argv[2])
print(json.dumps(time.perf_counter() - t0))
"""


def timed(setup: str, code: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", TIMER, setup, code], capture_output=True, text=True, check=True
    )
    return float(json.loads(out.stdout))


def floor(runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    print(f"start-up costs, median of {runs} fresh processes ({sys.executable})")
    ms = statistics.median(floor(runs)) * 1000
    print(f"  {'python -c pass (a whole process)':<40} {ms:7.1f} ms")
    for name, (setup, code) in PROBES.items():
        timed(setup, code)  # warm-up: the page cache
        ms = statistics.median(timed(setup, code) for _ in range(runs)) * 1000
        print(f"  {name:<40} {ms:7.1f} ms")


if __name__ == "__main__":
    main()
