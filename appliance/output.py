"""What the CLI prints: human text by default, one JSON envelope with --json.

Results go to stdout, progress and errors to stderr, so `b70ctl status --json | jq` always works.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from appliance.errors import ApplianceError

ENVELOPE_VERSION = 1


def emit_json(result: Any) -> None:
    print(
        json.dumps(
            {"version": ENVELOPE_VERSION, "ok": True, "result": result}, indent=2, sort_keys=True
        )
    )


def emit_json_error(error: ApplianceError) -> None:
    body: dict[str, object] = {"code": error.code, "message": error.message, "hint": error.hint}
    if error.details:
        body["details"] = error.details
    print(
        json.dumps(
            {"version": ENVELOPE_VERSION, "ok": False, "error": body}, indent=2, sort_keys=True
        )
    )


def emit_error(error: ApplianceError) -> None:
    print(f"error: {error.message}", file=sys.stderr)
    if error.hint:
        print(f"hint: {error.hint}", file=sys.stderr)


def progress(phase: str, detail: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"{stamp} {phase}: {detail}", file=sys.stderr, flush=True)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def render_status(s: dict[str, Any]) -> str:
    lines = [f"runtime   {s['active_runtime'] or ', '.join(s['active_runtimes']) or 'none active'}"]
    rows = [["UNIT", "ACTIVE", "SUB", "ENABLED", "PID"]]
    for u in s["units"]:
        rows.append(
            [u["unit"], u["active"], u["sub"], u["enabled"] or "-", str(u["main_pid"] or "-")]
        )
    lines.append(table(rows))
    for key in ("backend", "proxy"):
        p = s[key]
        lines.append(
            f"{key:<9} {p['url']}  {'healthy' if p['healthy'] else 'unhealthy: ' + p['detail']}"
        )
    last = s.get("last_switch")
    if last:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["at"]))
        outcome = (
            "ok" if last["ok"] else ("failed, rolled back" if last["rolled_back"] else "failed")
        )
        lines.append(
            f"last switch  {last['from'] or '-'} -> {last['to']} at {when}, "
            f"{last['seconds']:.1f} s, {outcome}"
        )
    else:
        lines.append("last switch  none")
    return "\n".join(lines)


def render_switch(r: dict[str, Any]) -> str:
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items())
    lines = [
        f"{r['target']} is serving (from {r['previous'] or 'none'}, {r['seconds']:.1f} s: {phases})"
    ]
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)
