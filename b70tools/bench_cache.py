"""vLLM's lasting compile cache on the demo, from one run (scripts/bench-cache).

The demo appliance (examples/demo.toml: vLLM's CPU build with torch.compile on) under a private
user manager, installed without its warm-up. Then, each through `b70ctl switch` from llama.cpp:
a start of vLLM with its recipe's cache folder emptied, and `--starts` more with the cache kept;
then the same vLLM with --enforce-eager (installed again: another recipe), for the start the demo
had before it compiled. Prints each start's "init engine" time as vLLM logged it, what the
switch found in the cache, and the switch's own time; and the ratios of one run: a warm "init
engine" over the cold one, a warm switch over an eager one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from b70tools.demo_appliance import Demo, demo_appliance, recipe_folder

CACHE = os.environ.get("B70_CACHE", str(Path.home() / ".cache" / "b70"))
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def b70ctl(demo: Demo, *args: str) -> dict[str, Any]:
    out = subprocess.run([*demo.b70ctl, *args, "--json"], env=demo.env, capture_output=True)
    doc: dict[str, Any] = json.loads(out.stdout)
    if not doc["ok"]:
        raise SystemExit(f"b70ctl {' '.join(args)}: {doc['error']['message']}")
    result: dict[str, Any] = doc["result"]
    return result


def start(demo: Demo, label: str, log: Any) -> dict[str, Any]:
    """One switch to vLLM and back: its time, and what the start said."""
    result = b70ctl(demo, "switch", "vllm")
    journal = subprocess.run(
        [*demo.b70ctl, "logs", "vllm", "-n", "2000"], env=demo.env, capture_output=True, text=True
    ).stdout
    inits = INIT.findall(journal)
    found = result.get("start") or {}
    row = {
        "start": label,
        "cache": found.get("verdict") or "-",
        "cause": found.get("cause"),
        "init_engine_s": float(inits[-1]) if inits else None,
        "switch_s": result["seconds"],
        "load_failure": "load failure" in journal.split("b70 cache:")[-1],
    }
    log(f"{label}: switch {row['switch_s']:.1f} s, init engine {row['init_engine_s']} s")
    b70ctl(demo, "switch", "llamacpp")
    return row


def show(rows: list[dict[str, Any]]) -> str:
    wide = max(len(r["start"]) for r in rows)
    lines = [f"{'start':<{wide}} {'cache':<6} {'init engine s':>13} {'switch s':>9}"]
    for r in rows:
        init = "-" if r["init_engine_s"] is None else f"{r['init_engine_s']:.2f}"
        cause = f"  ({r['cause']})" if r["cause"] else ""
        cells = f"{r['cache']:<6} {init:>13} {r['switch_s']:>9.1f}"
        lines.append(f"{r['start']:<{wide}} {cells}{cause}")
    cold = next(r for r in rows if r["start"].startswith("cold"))
    warm = [r for r in rows if r["start"].startswith("warm")]
    eager = [r for r in rows if r["start"].startswith("eager")]
    if cold["init_engine_s"] and all(r["init_engine_s"] for r in warm):
        ratios = ", ".join(f"{r['init_engine_s'] / cold['init_engine_s']:.2f}" for r in warm)
        lines.append(f"warm init engine / cold: {ratios} (target: at most 0.40)")
    if eager:
        base = statistics.median(r["switch_s"] for r in eager)
        ratios = ", ".join(f"{r['switch_s'] / base:.2f}" for r in warm)
        lines.append(f"warm switch / --enforce-eager switch ({base:.1f} s): {ratios}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=2, help="warm starts after the cold one")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if not 1 <= args.starts <= 10:
        raise SystemExit(f"--starts: 1 to 10 warm starts, not {args.starts}")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = []
    with demo_appliance(CACHE, prefix="b70-bench-cache.", threads=1, compiled=True) as demo:
        folder = recipe_folder(demo.env, "vllm")
        shutil.rmtree(folder, ignore_errors=True)  # the cache emptied
        rows.append(start(demo, "cold (cache emptied)", log))
        for n in range(1, args.starts + 1):
            rows.append(start(demo, f"warm {n}", log))
        config = Path(demo.b70ctl[-1])
        compiled = 'args = ["--max-model-len"'
        text = config.read_text()
        if compiled not in text:
            raise SystemExit(f"{config}: no `{compiled}` to add --enforce-eager to")
        config.write_text(text.replace(compiled, 'args = ["--enforce-eager", "--max-model-len"'))
        b70ctl(demo, "install")
        for n in range(1, 3):
            rows.append(start(demo, f"eager {n} (--enforce-eager)", log))
    print(show(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
