"""Measure `b70ctl switch` between the demo runtimes (run through scripts/bench-switch).

For each switch it prints:
  wall       the whole `b70ctl switch` process, as a client of the controller sees it;
  stop       the old runtime's stop (systemd: ActiveExit -> InactiveEnter of the old unit);
  runtime    the new runtime's start-up: ExecStart to healthy (ExecMainStart -> ActiveEnter);
  unit       from the old unit's stop to the new unit active (what systemd does for the switch);
  verify     the completion through the proxy that proves the switch;
  overhead   wall - unit - verify: the controller's own cost (start-up, preflight, polling, enable).

The package's bytecode is compiled first, as `pip install` does: b70ctl from an installed wheel
never compiles its modules at start-up, and neither does a checkout whose Python may write
__pycache__. Where PYTHONDONTWRITEBYTECODE is set and nothing compiled them, every run would
compile the controller's modules from source again (about 0.1 s here).
"""

from __future__ import annotations

import compileall
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from b70tools.demo_appliance import demo_appliance

REPO = Path(__file__).resolve().parent.parent


def show(env: dict[str, str], unit: str) -> dict[str, int]:
    keys = ",".join(
        f"{k}TimestampMonotonic"
        for k in ("ActiveEnter", "ActiveExit", "InactiveEnter", "ExecMainStart")
    )
    out = subprocess.run(
        ["systemctl", "--user", "show", "-p", keys, unit],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return {k: int(v) for k, v in (line.split("=", 1) for line in out.stdout.splitlines())}


def main() -> None:
    cache, rounds = sys.argv[1], int(sys.argv[2])
    compileall.compile_dir(REPO / "appliance", quiet=1)
    rows: dict[str, list[dict[str, float]]] = {"llamacpp -> vllm": [], "vllm -> llamacpp": []}
    with demo_appliance(cache) as demo:
        env, base = demo.env, demo.b70ctl
        for _ in range(rounds):
            for old, new in (("llamacpp", "vllm"), ("vllm", "llamacpp")):
                t0 = time.monotonic()
                out = subprocess.run(
                    [*base, "switch", new, "--json"], env=env, capture_output=True, text=True
                )
                wall = time.monotonic() - t0
                if out.returncode != 0:
                    raise SystemExit(f"switch to {new} failed:\n{out.stderr}")
                result = json.loads(out.stdout)["result"]
                o, n = show(env, f"b70-{old}.service"), show(env, f"b70-{new}.service")
                stop = (
                    o["InactiveEnterTimestampMonotonic"] - o["ActiveExitTimestampMonotonic"]
                ) / 1e6
                runtime = (
                    n["ActiveEnterTimestampMonotonic"] - n["ExecMainStartTimestampMonotonic"]
                ) / 1e6
                unit = (
                    n["ActiveEnterTimestampMonotonic"] - o["ActiveExitTimestampMonotonic"]
                ) / 1e6
                verify = result["phases"]["verified"]
                row = {
                    "wall": wall,
                    "stop": stop,
                    "runtime": runtime,
                    "unit": unit,
                    "verify": verify,
                    "overhead": wall - unit - verify,
                }
                rows[f"{old} -> {new}"].append(row)
                print(
                    f"{old:>8} -> {new:<8} " + "  ".join(f"{k} {v:6.2f} s" for k, v in row.items()),
                    flush=True,
                )
    print(f"\nmedians over {rounds} round(s):")
    for direction, samples in rows.items():
        med = {k: statistics.median(r[k] for r in samples) for k in samples[0]}
        print(
            f"{direction:<17} "
            + "  ".join(f"{k} {v:6.2f} s" for k, v in med.items())
            + f"  overhead/wall {med['overhead'] / med['wall']:.1%}"
        )


if __name__ == "__main__":
    main()
