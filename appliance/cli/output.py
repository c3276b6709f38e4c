"""What the CLI prints: human text by default, one JSON envelope with --json.

Results go to stdout, progress and errors to stderr, so `b70ctl status --json | jq` always works.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from appliance.errors import ApplianceError
from appliance.measure.startlog import plan_fix, plan_log

ENVELOPE_VERSION = 1


def show(as_json: bool, doc: Any, text: Callable[[], str] | None = None) -> None:
    """A command's result: the JSON envelope with --json, else `text()` (nothing if None)."""
    if as_json:
        emit_json(doc)
    elif text is not None:
        rendered = text()
        if rendered:
            print(rendered, flush=True)


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


def log(message: str) -> None:
    """A line for the journal or the terminal, on stderr."""
    print(message, file=sys.stderr, flush=True)


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
    lines.append(_units_table(s["units"]))
    # The APIs each runtime speaks through the proxy (docs/proxy.md, "Every API")
    apis = [(u["unit"], u["apis"]) for u in s["units"] if u.get("apis")]
    for i, (unit, names) in enumerate(apis):
        lines.append(f"{'apis' if i == 0 else '':<9} {unit}: {' '.join(names)}")
    for key in ("backend", "proxy"):
        p = s[key]
        lines.append(
            f"{key:<9} {p['url']}  {'healthy' if p['healthy'] else 'unhealthy: ' + p['detail']}"
        )
    tls = s["proxy"].get("tls")
    if tls:
        kind = "self-signed " if tls["self_signed"] else ""
        fp = tls["fingerprint"] or "cannot be read (by you, or yet: `b70ctl install` makes it)"
        lines.append(f"tls       {kind}certificate {tls['cert']}, SHA-256 fingerprint {fp}")
    held = s.get("hold")
    if held:
        doing = f"switching to {held['switching_to']}; " if held["switching_to"] else ""
        if held.get("mark_problem"):
            doing = f"every request is held: the hold mark cannot be read: {held['mark_problem']}; "
        lines.append(
            f"requests  {doing}{held['held_now']} waiting at the proxy now, "
            f"{held['held_total']} waited since it started, {held['timed_out_total']} got 503"
        )
    lines += _last_switch_lines(s.get("last_switch"))
    lines += _demand_lines(s.get("demand"))
    killed = s.get("killed_switch")
    if killed:
        lines.append(
            f"killed switch  to {killed.get('target')} (pid {killed.get('pid')}) during "
            f"{killed.get('phase')}: waits to be recovered by the monitor, the next switch or "
            "install"
        )
    mon = s.get("monitor")
    if mon:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mon["up_since"]))
        lines.append(
            f"monitor   up since {since}; {mon['restarts_by_monitor']} restarts, "
            f"{mon['failovers']} failovers"
        )
        if mon.get("last_failure"):
            f = mon["last_failure"]
            lines.append(f"  last failure  {f['runtime']}: {f['reason']}")
        if mon.get("last_action"):
            a = mon["last_action"]
            result = f" -> {a['result']}" if a.get("result") else ""
            lines.append(f"  last action   {a['what']} {a['runtime']}: {a['reason']}{result}")
    return "\n".join(lines)


def _units_table(units: list[dict[str, Any]]) -> str:
    placed = any(u.get("cards") for u in units)
    # Runtimes side by side: which port and name each serves
    served = len({(u["port"], u["model"]) for u in units if u.get("port")}) > 1
    rows = [["UNIT", "ACTIVE", "SUB", "ENABLED", "PID", "RESTARTS"] + (["CARDS"] if placed else [])]
    rows[0] += ["PORT", "MODEL"] if served else []
    for u in units:
        restarts = "-" if u.get("restarts") is None else str(u["restarts"])
        pid = str(u["main_pid"] or "-")
        row = [u["unit"], u["active"], u["sub"], u["enabled"] or "-", pid, restarts]
        row += [u.get("cards") or "-"] if placed else []
        row += [str(u.get("port") or "-"), u.get("model") or "-"] if served else []
        rows.append(row)
    return table(rows)


def _last_switch_lines(last: dict[str, Any] | None) -> list[str]:
    if not last:
        return ["last switch  none"]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["at"]))
    outcome = "ok" if last["ok"] else ("failed, rolled back" if last["rolled_back"] else "failed")
    if last.get("interrupted"):
        outcome += ", interrupted"
    lines = [
        f"last switch  {last['from'] or '-'} -> {last['to']} at {when}, "
        f"{last['seconds']:.1f} s, {outcome} ({last.get('reason', 'by hand')})"
    ]
    if last.get("error"):
        lines.append("  " + last["error"].splitlines()[0])
    start = last.get("start")
    if isinstance(start, dict) and start.get("verdict"):  # its lasting cache (engines.lasting)
        from appliance.engines.lasting import start_note

        lines.append("  " + start_note(last["to"], start))
    return lines


def _demand_lines(d: dict[str, Any] | None) -> list[str]:
    """The switch on demand: what waits for which runtime, why it waits, the pin, refusals."""
    if not d:
        return []
    lines = []
    if d["on_demand"]:
        why = d.get("decision") or {}
        order = {"fcfs": " (first come, first served)", "collated": " (collated)"}.get(
            str(d.get("order")), ""
        )
        lines.append(f"on demand  yes{order}{'; ' + why['reason'] if why.get('reason') else ''}")
        for name, cost in (d.get("costs") or {}).items():
            known = "last switch" if cost["from"] == "records" else "engine's default"
            apart = [f"{k} {cost[k + '_s']:.0f} s" for k in ("cold", "warm") if cost.get(k + "_s")]
            if cost.get("next"):
                known = f"its cache is {cost['next']}; " + ", ".join([*apart, known])
            lines.append(f"  swap to   {name} takes {cost['seconds']:.0f} s ({known})")
    for q in d["queues"]:
        lines.append(
            f"  queue     {q['waiting']} for {q['model']} ({q['runtime']}), "
            f"the oldest {q['oldest_s']:.0f} s"
        )
    if d.get("pin"):
        pin = d["pin"]
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pin["until"]))
        lines.append(f"pin       {pin['runtime']} until {until} (`b70ctl unpin` ends it)")
    for r in d["refused"]:
        lines.append(
            f"refused   {r['runtime']} for {r['left_s']:.0f} s more: it failed to start on "
            f"demand: {r['why']}"
        )
    return lines


def render_switch(r: dict[str, Any]) -> str:
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items())
    lines = [
        f"{r['target']} is serving (from {r['previous'] or 'none'}, {r['seconds']:.1f} s: {phases})"
    ]
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def size(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024**3:.1f} GiB"


def gpu_document(snap: Any) -> dict[str, Any]:
    return {
        "devices": [
            {
                "pci_slot": m.device.pci_slot,
                "name": m.device.name,
                "vendor_id": f"{m.device.vendor_id:#06x}",
                "device_id": f"{m.device.device_id:#06x}",
                "driver": m.device.driver,
                "card": m.device.card,
                "render_node": m.device.render_node,
                "total_bytes": m.total_bytes,
                "used_bytes": m.used_bytes,
                "free_bytes": m.free_bytes,
                "source": m.source,
                "error": m.error,
                "holders": [
                    {"pid": h.pid, "command": h.command, "unit": h.unit, "vram_bytes": b}
                    for h, b in m.holders
                ],
            }
            for m in snap.devices
        ],
        "unreadable_pids": snap.unreadable_pids,
        "other_gpus": [d.pci_slot for d in snap.ignored],
    }


def render_gpu(snap: Any) -> str:
    if not snap.devices:
        return "no Intel GPU found"
    rows = [["DEVICE", "NAME", "DRIVER", "RENDER", "TOTAL", "USED", "FREE", "SOURCE"]]
    for m in snap.devices:
        d = m.device
        name = d.name or f"{d.vendor_id:04x}:{d.device_id:04x}"
        rows.append(
            [
                d.pci_slot,
                name,
                d.driver or "-",
                d.render_node or "-",
                size(m.total_bytes),
                size(m.used_bytes),
                size(m.free_bytes),
                m.source,
            ]
        )
    lines = [table(rows)]
    holders = [["PID", "UNIT", "DEVICE", "VRAM", "COMMAND"]]
    for m in snap.devices:
        for h, b in m.holders:
            holders.append(
                [str(h.pid), h.unit or "-", m.device.pci_slot, size(b), (h.command or "?")[:60]]
            )
    if len(holders) > 1:
        lines += ["", table(holders)]
    for m in snap.devices:
        if m.error:
            lines.append(f"note: {m.error}")
        if m.used_bytes is None and m.total_bytes is not None:
            lines.append(
                f"note: {m.device.pci_slot}: reading used memory needs CAP_PERFMON; "
                "free is estimated from the holders"
            )
    if snap.unreadable_pids:
        lines.append(
            f"note: {snap.unreadable_pids} processes could not be read (other users, or GPU"
            " clients whose fdinfo is withheld): their VRAM is not in the list"
        )
    return "\n".join(lines)


def plan_document(p: Any, serve: Any, where: str) -> dict[str, Any]:
    import dataclasses

    doc = dataclasses.asdict(p)
    doc.update(config=where, log=plan_log(p), ignored_flags=list(serve.ignored))
    if not p.fits:
        doc["fix"] = plan_fix(p)
    return doc


def render_plan(p: Any, serve: Any = None, compared: Any = None) -> str:
    mib = 1024**2
    lines = ["vLLM's start-up, as planned:"]
    lines += ["  " + line for line in plan_log(p)]
    tokens = f"{p.tokens:,}"
    lines.append(f"requests of {tokens} tokens at once: {p.requests_fit}")
    if not p.fits:
        lines.append(f"to fit: {plan_fix(p)}")
    g = p.paging
    card = "each card" if p.cards > 1 else "the card"
    lines += [
        f"parameters             {p.params / 1e9:.2f} B "
        f"({p.active_params_per_token / 1e9:.2f} B active per token)",
        f"weights                {size(p.weight_bytes)}"
        + (
            f", {size(p.cpu_offload_bytes)} on {card} offloaded to the CPU"
            if p.cpu_offload_bytes
            else ""
        ),
        f"GDN state per request  {p.gdn_state_bytes / mib:.1f} MiB "
        f"(+ conv state {p.conv_state_bytes / mib:.2f} MiB)",
        f"KV cache per token     {p.kv_bytes_per_token / 1024:.1f} KiB",
        f"cache layout           {g.attention_groups} attention + "
        + (f"{g.window_groups} windowed + " if g.window_groups else "")
        + f"{g.state_groups} GDN group(s) "
        f"of {g.group_size} layers, {g.blocks} blocks; {g.blocks_per_request} a request of "
        f"{tokens} tokens, {g.blocks_per_max_len} of {p.max_model_len:,}",
    ]
    lines += budget_lines(p.budget, card)
    for step in p.steps:
        lines.append(
            f"decode step, batch {int(step['batch']):<4} {step['step_ms']:.2f} ms "
            f"({step['tokens_per_s']:.0f} tok/s, memory-bound)"
        )
    for note in p.unsure:
        lines.append(f"unsure: {note}")
    if serve is not None and serve.ignored:
        lines.append("not planned (no effect on memory here): " + " ".join(serve.ignored))
    if compared is not None:
        lines.append(f"against the vLLM at {compared.url}:")
        rows = [["", "PLANNED", "VLLM REPORTS", "APART"]]
        for r in compared.rows:
            apart = "-" if r.apart is None else f"{r.apart:+.1%}"
            rows.append([r.what, f"{r.planned:.6g}", f"{r.reported:.6g}", apart])
        if not compared.rows:
            rows.append(["(vLLM reported none of the figures the plan has)", "", "", ""])
        lines.append(table(rows))
    return "\n".join(lines)


def _gib2(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def budget_lines(b: Any, card: str) -> list[str]:
    """The cache's budget on each card, term by term, as the plan's vLLM release takes it."""
    release = ".".join(str(n) for n in b.release)
    if b.given:
        return [f"cache on {card}          {_gib2(b.available)} (given: vLLM does not profile it)"]
    lines = [
        f"budget on {card} (vLLM {release}):",
        f"  asks for         {_gib2(b.requested)} ({b.utilization:g} of {_gib2(b.total)})",
    ]
    for term in b.terms:
        lines.append(f"  - {term.key:<14} {_gib2(term.bytes)} ({term.basis}: {term.what})")
    lines.append(
        f"  = cache          {_gib2(b.available)}, between {_gib2(b.least)} and {_gib2(b.most)} "
        "by the fitted terms' error on the B70 logs"
    )
    return lines


class ProgressBar:
    """A one-line progress bar on stderr (only on a terminal)."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def update(self, done: int, total: int, tokens: int) -> None:
        width = 30
        filled = width * done // total
        rate = tokens / max(time.monotonic() - self.start, 1e-9)
        bar = "#" * filled + "." * (width - filled)
        print(
            f"\r[{bar}] {done}/{total} requests, {rate:.0f} tok/s",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        print(file=sys.stderr)


def render_bench(s: dict[str, Any], concurrency: int) -> str:
    def pair(key: str) -> str:
        return f"median {s[key]['median']} ms, p99 {s[key]['p99']} ms"

    run = s["running_at_once"]
    lines = [
        f"requests         {s['succeeded']}/{s['requests']} succeeded in {s['wall_s']} s",
        f"TTFT             {pair('ttft_ms')}",
        f"TPOT             {pair('tpot_ms')}",
        f"ITL              {pair('itl_ms')}",
        f"output tokens/s  {s['output_tokens_per_s']}  (total {s['total_tokens_per_s']})",
        f"running at once  max {run['max']}, median {run['median']} ({run['samples']} samples)",
    ]
    if s["valid"]:
        lines.append(
            f"generation       {s['generation_tokens_per_s']} tok/s ({concurrency} / median TPOT)"
        )
    else:
        lines.append("generation       INVALID: " + "; ".join(s["invalid_because"]))
    return "\n".join(lines)


def render_files(written: list[str]) -> str:
    return "\n".join(written)


def render_listing(files: dict[str, str]) -> str:
    return "\n".join(f"# ---- {name}\n{text}" for name, text in files.items())


def render_install(r: dict[str, Any]) -> str:
    lines = [f"removed {path}: its runtime is not in the config any more" for path in r["removed"]]
    lines += [f"wrote {path}" for path in r["written"]]
    if not r["written"]:
        lines.append("every file was already current")
    if r["key_created"]:
        lines.append("created the proxy key file")
    change = r["config"]
    if change is not None and change["backup"]:
        lines.append(f"replaced {change['path']}; the previous file is kept as {change['backup']}:")
        lines.append(change["diff"].rstrip("\n"))
    elif change is not None:
        lines.append(f"wrote {change['path']}")
    lines.append(f"enabled {', '.join(r['enabled'])}")
    if r["tls"] is not None:
        lines.append(render_tls(r["tls"]))
    lines += [f"started {unit}" for unit in r["started"]]
    lines += [f"note: {note}" for note in r["notes"]]
    return "\n".join(lines)


def render_tls(tls: dict[str, Any]) -> str:
    """The certificate the proxy serves: what a client compares before it trusts it."""
    made = (
        " (self-signed, made now)" if tls["new"] else " (self-signed)" if tls["self_signed"] else ""
    )
    return f"TLS: certificate {tls['cert']}{made}, SHA-256 fingerprint {tls['fingerprint']}"


def render_removed(removed: list[str], kept: list[str] | None = None) -> str:
    lines = [f"removed {path}" for path in removed]
    lines += [f"kept    {path} (not made by the appliance)" for path in kept or []]
    return "\n".join(lines)


def render_checks(checks: list[dict[str, Any]]) -> str:
    """One line per check (`doctor`, `gate`), and under a failed one its fix, where it has one."""
    lines = []
    for c in checks:
        lines.append(f"{'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}")
        if c.get("fix") and not c["ok"]:
            lines.append(f"     fix: {c['fix']}")
    return "\n".join(lines)
