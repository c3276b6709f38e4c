"""A crowd at the door (run through `scripts/bench-fair --crowd N`).

The demo appliance under a private user manager, llama.cpp serving with `--parallel 2`, two
keys made with `b70ctl keys add`: `crowd`, a batch key (`--priority batch`), keeps N requests
open at all times (8 tokens each; one that ends or is refused is sent again), so that about N
wait their turn at the door; `light`, an interactive key, sends one streamed request every
GAP_S seconds, and its time to first token (from its send to its first chunk with text) is
taken. The hold's limit is raised (HOLD_S) so that the crowd waits rather than gets 503s.

Under each policy (`on`, as shipped; `keep1`, `keep_free = 1`; `share`, `batch_share = 0.4`;
`direct`, no door), in one run: light alone, then light beside a crowd of SMALL_CROWD, then
beside a crowd of N. Each phase with a crowd first
waits until the door holds the crowd (RAMP_S at most), then measures for DURATION seconds:
- the requests waiting at the door, read from the door's own record of turns (the most, and
  the mean, sampled every second);
- light's p50 and p95 time to first token, and its p95 against its p95 alone;
- the door's CPU: the CPU time of the proxy's processes (its main process and its workers, from
  /proc) over the phase, a second and per answered request.
The crowd runs in a process of its own, so that its event loop's work does not delay light's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import resource
import sqlite3
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import httpx
import psutil

from b70tools.bench_demand import CACHE, percentile
from b70tools.demo_appliance import Demo, demo_appliance

SMALL_CROWD = 5
GAP_S = 1.0
HOLD_S = 1800
RAMP_S = 300.0
POLICIES = {"on": "", "keep1": "keep_free = 1", "share": "batch_share = 0.4", "direct": ""}
# `direct`: no door. The crowd goes straight to the runtime's port, as many as it runs at once
# (all the door ever lets through), and light too: the floor the runtime itself sets.
PLACES = {"demo": 2, "b70": 64}
BATCH_BODY = {"model": "smollm2", "max_tokens": 8, "temperature": 0,
              "messages": [{"role": "user", "content": "Say hi."}]}  # fmt: skip
LIGHT_BODY = {**BATCH_BODY, "stream": True}


@dataclass
class Phase:
    crowd: int
    ttft_s: list[float] = field(default_factory=list)
    answered: int = 0  # requests answered 200 in the measured window, both keys
    refused: int = 0  # crowd requests answered otherwise (then sent again)
    errors: list[str] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # sampled in the measured window
    cpu_s: float = 0.0
    seconds: float = 0.0


def b70ctl(demo: Demo, *args: str) -> dict[str, Any]:
    out = subprocess.run([*demo.b70ctl, *args, "--json"], env=demo.env, capture_output=True,
                         text=True, check=False)  # fmt: skip
    doc: dict[str, Any] = json.loads(out.stdout or "{}")
    if not doc.get("ok"):
        raise SystemExit(f"b70ctl {' '.join(args)}: {doc.get('error')}")
    return doc["result"]


def door_cpu_s(demo: Demo) -> float:
    """CPU seconds of the proxy's main process and its workers so far."""
    pid = subprocess.run(
        ["systemctl", "--user", "show", "-p", "MainPID", "--value", "b70-litellm.service"],
        env=demo.env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    main = psutil.Process(int(pid))
    total = 0.0
    for proc in [main, *main.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def waiting_at_the_door(demo: Demo) -> int:
    """Requests waiting their turn, as the door's record of turns has them."""
    held = Path(demo.env["XDG_STATE_HOME"]) / "b70" / "held"
    total = 0
    for path in held.glob("turns-*.db"):
        with contextlib.suppress(sqlite3.Error):
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
            try:
                total += int(db.execute("SELECT COALESCE(SUM(count), 0) FROM queued").fetchone()[0])
            finally:
                db.close()
    return total


class Counts:
    """What the crowd's process counts, shared with the bench's."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self.measuring, self.stop = ctx.Event(), ctx.Event()
        self.answered, self.refused, self.errors = (
            ctx.Value("i", 0),
            ctx.Value("i", 0),
            ctx.Value("i", 0),
        )
        self.ctx = ctx


async def post_each(
    host: str, port: int, path: str, body: bytes, key: str, stop: Any
) -> Any:  # fmt: skip
    """One connection of the crowd: the same POST again and again on one kept-alive connection
    (a new one when the door closes it), yielding each answer's status. h11 on a stream of its
    own, so that each request costs the client the same whatever the crowd's size (httpx's pool
    goes through every connection it holds at each request and each answer, which with 5,000
    took most of a core of this machine's two from the runtime and the door)."""
    head = [("Host", f"{host}:{port}"), ("Authorization", f"Bearer {key}"),
            ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]  # fmt: skip
    while not stop.is_set():
        reader, writer = await asyncio.open_connection(host, port)
        conn = h11.Connection(h11.CLIENT)
        try:
            while not stop.is_set() and conn.our_state is h11.IDLE:
                writer.write(conn.send(h11.Request(method="POST", target=path, headers=head)))
                writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                status = 0
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                        break
                yield status
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
        finally:
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()


def crowd_process(url: str, key: str, crowd: int, counts: Counts) -> None:
    """The crowd, in a process of its own (its event loop's work is not the light key's):
    `crowd` requests kept open, each sent again when it ends."""
    where = httpx.URL(url)
    body = json.dumps(BATCH_BODY).encode()

    async def main() -> None:
        async def batch() -> None:
            while not counts.stop.is_set():
                try:
                    answers = post_each(where.host, where.port or 80, where.path, body, key,
                                        counts.stop)  # fmt: skip
                    async for status in answers:
                        if counts.measuring.is_set() and not counts.stop.is_set():
                            if status == 200:
                                counts.answered.value += 1
                            else:
                                counts.refused.value += 1
                        if status != 200:
                            await asyncio.sleep(1.0)
                except (OSError, h11.ProtocolError):
                    counts.errors.value += 1
                    await asyncio.sleep(1.0)

        tasks = []
        for i in range(crowd):
            tasks.append(asyncio.create_task(batch()))
            if i % 100 == 99:
                await asyncio.sleep(0.05)  # the crowd comes over a moment, not in one packet
        while not counts.stop.is_set():
            await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def has_text(line: str) -> bool:
    """A chunk of a streamed chat completion (`data: {...}`) with text in it."""
    try:
        choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    except ValueError:
        return False
    return bool((choices[0].get("delta") or {}).get("content"))


async def run_phase(
    demo: Demo, keys: dict[str, str], crowd: int, seconds: float, log: Any, direct: bool = False,
    places: int = 2,
) -> Phase:  # fmt: skip
    phase = Phase(crowd)
    port = demo.backend_port if direct else demo.proxy_port
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    counts = Counts()
    crowd_proc = counts.ctx.Process(target=crowd_process, args=(url, keys["crowd"], crowd, counts))
    if crowd:
        crowd_proc.start()
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(HOLD_S + 60.0)) as http:

            async def light() -> None:
                headers = {"Authorization": f"Bearer {keys['light']}"}
                sent = time.monotonic()
                first = None
                try:
                    async with http.stream("POST", url, json=LIGHT_BODY, headers=headers) as r:
                        async for line in r.aiter_lines():
                            if first is None and line.startswith("data: {") and has_text(line):
                                first = time.monotonic() - sent
                    ok = r.status_code == 200
                except httpx.HTTPError as e:
                    phase.errors.append(f"light: {type(e).__name__}: {e}"[:200])
                    return
                if ok and first is not None and not counts.stop.is_set():
                    phase.ttft_s.append(first)
                    phase.answered += 1

            ramp_end = time.monotonic() + (5.0 if direct else RAMP_S)
            while crowd and direct and time.monotonic() < ramp_end:
                await asyncio.sleep(1.0)  # the runtime full: nothing waits at the door
            while crowd and not direct and time.monotonic() < ramp_end:
                if await asyncio.to_thread(waiting_at_the_door, demo) >= crowd - places - 2:
                    await asyncio.sleep(3.0)  # a crowd that all runs: once it has come
                    break  # all but those running (and two more, alone)
                await asyncio.sleep(1.0)
            log(f"  crowd of {crowd}: {await asyncio.to_thread(waiting_at_the_door, demo)} waiting")
            cpu0, t0 = await asyncio.to_thread(door_cpu_s, demo), time.monotonic()
            counts.measuring.set()
            lights: list[asyncio.Task[None]] = []
            at = t0
            while at < t0 + seconds:
                lights.append(asyncio.create_task(light()))
                phase.waiting.append(await asyncio.to_thread(waiting_at_the_door, demo))
                at += GAP_S
                await asyncio.sleep(max(0.0, at - time.monotonic()))
            await asyncio.gather(*lights)
            phase.seconds = time.monotonic() - t0
            phase.cpu_s = await asyncio.to_thread(door_cpu_s, demo) - cpu0
            counts.stop.set()
    finally:
        counts.stop.set()
        if crowd:
            crowd_proc.join(60)
            if crowd_proc.is_alive():
                crowd_proc.kill()
    phase.answered += counts.answered.value
    phase.refused = counts.refused.value
    phase.errors += (
        [f"crowd: {counts.errors.value} connection errors"] if counts.errors.value else []
    )
    return phase


def set_policy(demo: Demo, policy: str) -> None:
    config = Path(demo.b70ctl[demo.b70ctl.index("--config") + 1])
    shaping = {"keep_free", "batch_share"}
    lines = [ln for ln in config.read_text().splitlines() if ln.split(" = ")[0] not in shaping]
    at = lines.index("[proxy]") + 1
    lines[at:at] = [POLICIES[policy]] if POLICIES[policy] else []
    config.write_text("\n".join(lines) + "\n")
    b70ctl(demo, "install")


def figures(policy: str, alone: Phase, phase: Phase) -> dict[str, Any]:
    alone_p95 = percentile(alone.ttft_s, 95)
    p95 = percentile(phase.ttft_s, 95)
    return {
        "policy": policy, "crowd": phase.crowd,
        "waiting_most": max(phase.waiting, default=0),
        "waiting_mean": statistics.fmean(phase.waiting) if phase.waiting else 0.0,
        "light_requests": len(phase.ttft_s),
        "light_p50_s": statistics.median(phase.ttft_s) if phase.ttft_s else None,
        "light_p95_s": p95, "light_alone_p95_s": alone_p95,
        "light_p95_ratio": p95 / alone_p95 if p95 and alone_p95 else None,
        "answered": phase.answered, "refused": phase.refused, "errors": phase.errors,
        "door_cpu_s": phase.cpu_s, "seconds": phase.seconds,
        "door_cpu_per_s": phase.cpu_s / phase.seconds if phase.seconds else None,
        "cpu_ms_per_request": 1000 * phase.cpu_s / phase.answered if phase.answered else None,
    }  # fmt: skip


def show(rows: list[dict[str, Any]]) -> str:
    def s(v: float | None, f: str = ".2f") -> str:
        return "-" if v is None else format(v, f)

    lines = [
        "policy  crowd  waiting most/mean  light p50  light p95 / alone (s)  p95 ratio  "
        "answered  door CPU s/s  ms/request  refused  errors"
    ]
    for r in rows:
        lines.append(
            f"{r['policy']:<6}  {r['crowd']:>5}  {r['waiting_most']:>8} / {r['waiting_mean']:<7.0f}"
            f"  {s(r['light_p50_s']):>9}  {s(r['light_p95_s']):>10}"
            f" / {s(r['light_alone_p95_s']):<8}"
            f"  {s(r['light_p95_ratio']):>9}  {r['answered']:>8}  {s(r['door_cpu_per_s']):>10}"
            f"  {s(r['cpu_ms_per_request']):>10}"
            f"  {r['refused']:>7}  {len(r['errors']):>6}"
        )
    lines.append("target: light p95 at most 2x its p95 alone; the door's CPU per request the same")
    lines.append(
        "policies: "
        + "; ".join(
            f"{k}: [proxy] {v or 'as shipped'}" for k, v in POLICIES.items() if k != "direct"
        )
        + "; direct: no door, the crowd straight to the runtime, as many as it runs "
        "at once"
    )
    return "\n".join(lines)


def crowd_main(
    crowd: int, seconds: float, policies: list[str], json_out: Path | None,
    b70_scale: float | None = None,
) -> None:  # fmt: skip
    """Each policy's phases, on the demo's llama.cpp, or with `b70_scale` on the B70 stand-in's
    vLLM (64 places, a B70's time per token; its start-up times scaled by it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * crowd + 1024)), hard))
    log = lambda m: print(m, flush=True)  # noqa: E731
    rows: list[dict[str, Any]] = []

    def rewrite(text: str) -> str:
        return text.replace("hold_s = 120", f"hold_s = {HOLD_S}")

    if b70_scale is None:
        appliance = demo_appliance(CACHE, prefix="b70-crowd.", rewrite=rewrite)
    else:
        from b70tools.bench_fair import B70_MODEL, b70_standin

        appliance = b70_standin(b70_scale)
        for body in (BATCH_BODY, LIGHT_BODY):
            body["model"] = B70_MODEL
    with appliance as demo:
        if b70_scale is not None:
            b70ctl(demo, "switch", "vllm")  # --max-num-seqs 64: 64 places
        keys = {
            "crowd": b70ctl(demo, "keys", "add", "crowd", "--priority", "batch")["key"],
            "light": b70ctl(demo, "keys", "add", "light")["key"],
        }
        for policy in policies:
            direct = policy == "direct"
            set_policy(demo, "on" if direct else policy)
            log(f"{policy}: light alone")
            places = PLACES["demo" if b70_scale is None else "b70"]
            alone = asyncio.run(run_phase(demo, keys, 0, seconds, log, direct, places))
            sizes = [min(SMALL_CROWD, places), places] if direct else [SMALL_CROWD, crowd]
            for size in sizes:
                log(f"{policy}: light beside a crowd of {size}")
                phase = asyncio.run(run_phase(demo, keys, size, seconds, log, direct, places))
                rows.append(figures(policy, alone, phase))
                log(json.dumps({k: v for k, v in rows[-1].items() if k != "errors"}))
    print(show(rows))
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1))
