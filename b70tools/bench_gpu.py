"""Figures for `b70ctl gpu` (run through scripts/bench-gpu).

1. Cold `b70ctl gpu --json`: a new process each time, on this machine and on a fixture tree of a
   B70 with llama-server holding 22 GiB (the tree has no real ioctl: its render node is a file).
   `python -c pass` in the same venv is the floor, measured in the same run.
2. One /proc scan (fdinfo.read_holders) with 500 extra `sleep` processes alive.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from appliance.host.gpu import fdinfo
from b70tools import gpu_trees

REPO = Path(__file__).resolve().parent.parent

PY = sys.executable
B70CTL = str(Path(sys.executable).parent / "b70ctl")


def wall(argv: list[str], runs: int) -> list[float]:
    subprocess.run(argv, capture_output=True, check=True)  # warm-up (page cache)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
    return times


def line(name: str, times: list[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    spread = f"min {ms[0]:7.1f}  max {ms[-1]:7.1f}  (n={len(ms)})"
    return f"{name:<44} median {statistics.median(ms):7.1f} ms  {spread}"


def main() -> None:
    runs = 21
    with tempfile.TemporaryDirectory() as tmp:
        tree = gpu_trees.build(
            Path(tmp) / "root",
            [gpu_trees.Card(gpu_trees.B70, vram_used=22 * gpu_trees.GIB)],
            [gpu_trees.llama_server()],
        )
        floor = wall([PY, "-c", "pass"], runs)
        here = wall([B70CTL, "gpu", "--json"], runs)
        fixture = wall([B70CTL, "gpu", "--json", "--root", str(tree)], runs)
    print(line("python -c pass (floor)", floor))
    print(line("b70ctl gpu --json (this machine)", here))
    print(line("b70ctl gpu --json (B70 fixture tree)", fixture))
    print(f"{'':<44} b70ctl/floor {statistics.median(here) / statistics.median(floor):.2f}")

    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(500)]
    try:
        pids = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit())
        scans = []
        for _ in range(7):
            t0 = time.perf_counter()
            fdinfo.read_holders(Path("/"))
            scans.append(time.perf_counter() - t0)
        print(line(f"one /proc scan, {pids} processes", scans))
    finally:
        for p in sleepers:
            p.kill()
        for p in sleepers:
            p.wait()


if __name__ == "__main__":
    main()
