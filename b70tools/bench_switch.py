"""Measure `b70ctl switch` between the demo runtimes (run through scripts/bench-switch).

For each switch it prints:
  wall       the whole `b70ctl switch` process, as a client of the controller sees it;
  stop       the old runtime's stop (systemd: ActiveExit -> InactiveEnter of the old unit);
  runtime    the new runtime's start-up: ExecStart to healthy (ExecMainStart -> ActiveEnter);
  unit       from the old unit's stop to the new unit active (what systemd does for the switch);
  verify     the completion through the proxy that proves the switch;
  overhead   wall - unit - verify: the controller's own cost (start-up, preflight, polling, enable);
  before     of the overhead, what came before the old unit's stop began (start-up, preflight);
  after      and what came after the new unit was active (noticing it, enable, record, exit).

The switches are run by b70ctl as `pip install` leaves it (the README's install on a real
B70): the package built and installed into a virtual environment of its own, its bytecode
compiled, its dependencies reached through a path file. The checkout's editable install would
add its import finder to every start-up (about 30 ms here: it imports pathlib, urllib.parse and
importlib.util before b70ctl runs), and a checkout whose Python may not write __pycache__
would compile every module from source again (about 0.1 s).
"""

from __future__ import annotations

import compileall
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
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


def installed_b70ctl(where: Path) -> str:
    """b70ctl installed from this checkout into a virtual environment of its own under
    `where`, as pip installs it; the dependencies are this environment's."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
    (site / "b70-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run([*pip, "--target", str(site), str(REPO)], check=True)
    compileall.compile_dir(site / "appliance", quiet=1)
    script = venv / "bin" / "b70ctl"  # the console script, in the shape pip writes it
    script.write_text(
        f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom appliance.cli import main\n"
        "if __name__ == '__main__':\n    sys.argv[0] = 'b70ctl'\n    sys.exit(main())\n"
    )
    script.chmod(0o755)
    # The proxy's program is found beside b70ctl, as in an installation.
    proxy = venv / "bin" / "b70-proxy"
    proxy.write_text(
        f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom appliance.proxy.mount import main\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )
    proxy.chmod(0o755)
    return str(script)


def switches(
    env: dict[str, str], base: list[str], rounds: int, cwd: str
) -> dict[str, list[dict[str, float]]]:
    """`rounds` switches each way, each split into the figures of the module's docstring."""
    rows: dict[str, list[dict[str, float]]] = {"llamacpp -> vllm": [], "vllm -> llamacpp": []}
    for _ in range(rounds):
        for old, new in (("llamacpp", "vllm"), ("vllm", "llamacpp")):
            t0 = time.monotonic()
            out = subprocess.run(
                [*base, "switch", new, "--json"],
                env=env,
                capture_output=True,
                text=True,
                cwd=cwd,  # not the checkout: its appliance/ would come first on the path
            )
            wall = time.monotonic() - t0
            if out.returncode != 0:
                raise SystemExit(f"switch to {new} failed:\n{out.stdout}{out.stderr}")
            result = json.loads(out.stdout)["result"]
            o, n = show(env, f"b70-{old}.service"), show(env, f"b70-{new}.service")
            stop = (o["InactiveEnterTimestampMonotonic"] - o["ActiveExitTimestampMonotonic"]) / 1e6
            runtime = (
                n["ActiveEnterTimestampMonotonic"] - n["ExecMainStartTimestampMonotonic"]
            ) / 1e6
            unit = (n["ActiveEnterTimestampMonotonic"] - o["ActiveExitTimestampMonotonic"]) / 1e6
            verify = result["phases"]["verified"]
            # systemd's monotonic timestamps are this clock's: what came before the old unit's
            # stop began, and what came after the new one was active (less the verification).
            before = o["ActiveExitTimestampMonotonic"] / 1e6 - t0
            after = t0 + wall - n["ActiveEnterTimestampMonotonic"] / 1e6 - verify
            row = {
                "wall": wall,
                "stop": stop,
                "runtime": runtime,
                "unit": unit,
                "verify": verify,
                "overhead": wall - unit - verify,
                "before": before,
                "after": after,
            }
            rows[f"{old} -> {new}"].append(row)
            print(
                f"{old:>8} -> {new:<8} " + "  ".join(f"{k} {v:6.2f} s" for k, v in row.items()),
                flush=True,
            )
    return rows


def main() -> None:
    cache, rounds = sys.argv[1], int(sys.argv[2])
    with tempfile.TemporaryDirectory(prefix="b70-bench-ctl.") as ctl:
        b70ctl = installed_b70ctl(Path(ctl))  # it installs the demo: its units run it too
        with demo_appliance(cache, b70ctl=b70ctl) as demo:
            rows = switches(demo.env, demo.b70ctl, rounds, cwd=ctl)
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
