"""Clients on the proxy port while the runtime is switched back and forth (scripts/load-test).

N clients (the OpenAI Python SDK, no retries) send requests through the proxy without pause: a
mix of streaming and non-streaming, chat completions and completions. First a steady phase with
no switch, then M switches alternating between two runtimes, run by `b70ctl switch` as a user
would. Every request is judged on its own:
  succeeded  a complete answer: a finish_reason, and a stream that ended with it;
  failed     an error before any answer (an HTTP error, a refused or dropped connection);
  truncated  a stream that broke, or ended without a finish_reason, after it had started.
Latency is the whole request (to the last chunk of a stream). A request counts as "during a
switch" when its time overlaps a `b70ctl switch` run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

PROMPTS = (
    "Name a colour of the sky.",
    "Count from one to five.",
    "Say something about the sea.",
    "What is two plus two?",
)


@dataclass(frozen=True)
class Target:
    proxy_url: str  # http://host:port
    api_key: str
    model: str
    b70ctl: list[str]  # the command that runs b70ctl against this appliance


@dataclass
class Outcome:
    kind: str  # one of KINDS
    start: float
    end: float
    result: str  # succeeded, failed, truncated
    error: str | None = None
    chunks: int = 0


@dataclass
class SwitchRun:
    target: str
    start: float
    end: float
    ok: bool
    seconds: float | None
    error: str | None = None


@dataclass(frozen=True)
class Replicas:
    """The runtime units that may serve the model, with their ports: the replicas of the sets
    switched between. Serving capacity is how many are active and not held by a switch."""

    units: dict[str, int]  # unit -> its port
    user: bool
    state_dir: Path


@dataclass
class Report:
    clients: int
    steady_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    switches: list[SwitchRun] = field(default_factory=list)
    capacity: list[int] = field(default_factory=list)  # replicas serving, sampled during switches

    def during_switch(self, o: Outcome) -> bool:
        return any(o.start < s.end and o.end > s.start for s in self.switches)

    def summary(self) -> dict[str, Any]:
        def group(items: list[Outcome]) -> dict[str, Any]:
            latencies = sorted(o.end - o.start for o in items if o.result == "succeeded")
            return {
                "sent": len(items),
                "succeeded": sum(o.result == "succeeded" for o in items),
                "failed": sum(o.result == "failed" for o in items),
                "truncated": sum(o.result == "truncated" for o in items),
                "p50_s": _percentile(latencies, 0.50),
                "p99_s": _percentile(latencies, 0.99),
            }

        during = [o for o in self.outcomes if self.during_switch(o)]
        outside = [o for o in self.outcomes if not self.during_switch(o)]
        errors: dict[str, int] = {}
        for o in self.outcomes:
            if o.error:
                errors[o.error] = errors.get(o.error, 0) + 1
        return {
            "clients": self.clients,
            "all": group(self.outcomes),
            "during_switches": group(during),
            "outside_switches": group(outside),
            "steady_phase": group([o for o in outside if not self.switches or o.end < self.t0()]),
            "switches": [asdict(s) for s in self.switches],
            "switches_failed": sum(not s.ok for s in self.switches),
            "capacity": {
                "lowest": min(self.capacity, default=None),
                "highest": max(self.capacity, default=None),
                "samples": len(self.capacity),
            },
            "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10]),
        }

    def t0(self) -> float:
        return min(s.start for s in self.switches)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return round(values[lo] + (values[hi] - values[lo]) * (k - lo), 3)


# What a client asks: OpenAI's chat and completions, streamed or not (the default mix), and
# OpenAI Responses and Anthropic Messages, through each SDK's streaming helper.
KINDS = ("chat", "chat-stream", "completion", "completion-stream", "responses-stream",
         "messages-stream")  # fmt: skip
DEFAULT_MIX = ("chat-stream", "chat", "completion-stream", "chat-stream", "completion", "chat")


async def one_request(
    client: Any, model: str, kind: str, prompt: str, max_tokens: int, anthropic_client: Any = None
) -> Outcome:
    import anthropic
    import openai

    start = time.monotonic()
    outcome = Outcome(kind, start, start, "failed")
    common: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    try:
        if kind in ("responses-stream", "messages-stream"):
            finished = await _helper_stream(client, anthropic_client, kind, prompt, common, outcome)
        elif kind.startswith("chat"):
            messages = [{"role": "user", "content": prompt}]
            if kind == "chat":
                reply = await client.chat.completions.create(messages=messages, **common)
                finished = reply.choices[0].finish_reason is not None
            else:
                stream = await client.chat.completions.create(
                    messages=messages, stream=True, **common
                )
                finished = await _drain(stream, outcome)
        else:
            if kind == "completion":
                reply = await client.completions.create(prompt=prompt, **common)
                finished = reply.choices[0].finish_reason is not None
            else:
                stream = await client.completions.create(prompt=prompt, stream=True, **common)
                finished = await _drain(stream, outcome)
        outcome.result = "succeeded" if finished else "truncated"
        if not finished:
            outcome.error = "ended without a finish_reason"
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        outcome.error = f"HTTP {e.status_code}: {str(e.message)[:300]}"
    except (openai.APIError, anthropic.APIError, OSError) as e:
        outcome.error = f"{type(e).__name__}: {str(e)[:120]}"
    if outcome.error and outcome.chunks:
        outcome.result = "truncated"
    outcome.end = time.monotonic()
    return outcome


async def _helper_stream(
    client: Any, anthropic_client: Any, kind: str, prompt: str, common: dict[str, Any],
    outcome: Outcome,
) -> bool:  # fmt: skip
    """One answer streamed through the SDK's own helper, which puts the events together: it
    finished when the helper's final answer says why it stopped."""
    model, max_tokens = common["model"], common["max_tokens"]
    if kind == "responses-stream":
        async with client.responses.stream(
            model=model, input=prompt, max_output_tokens=max_tokens, temperature=0
        ) as events:
            async for event in events:
                outcome.chunks += event.type == "response.output_text.delta"
            final = await events.get_final_response()
        return final.status in ("completed", "incomplete")
    # (the Anthropic SDK's stream() takes no temperature)
    async with anthropic_client.messages.stream(
        model=model, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}]
    ) as stream:
        async for _ in stream.text_stream:
            outcome.chunks += 1
        message = await stream.get_final_message()
    return message.stop_reason is not None


async def _drain(stream: Any, outcome: Outcome) -> bool:
    finished = False
    async for chunk in stream:
        outcome.chunks += 1
        if chunk.choices and chunk.choices[0].finish_reason is not None:
            finished = True
    return finished


async def client_loop(
    target: Target, index: int, stop: asyncio.Event, report: Report, max_tokens: int,
    kinds: tuple[str, ...] = DEFAULT_MIX,
) -> None:  # fmt: skip
    import anthropic
    import openai

    async with (
        openai.AsyncOpenAI(
            base_url=target.proxy_url + "/v1", api_key=target.api_key, max_retries=0, timeout=900
        ) as client,
        anthropic.AsyncAnthropic(
            base_url=target.proxy_url, api_key=target.api_key, max_retries=0, timeout=900
        ) as anthropic_client,
    ):
        n = index
        while not stop.is_set():
            kind, prompt = kinds[n % len(kinds)], PROMPTS[n % len(PROMPTS)]
            report.outcomes.append(
                await one_request(client, target.model, kind, prompt, max_tokens, anthropic_client)
            )
            n += 1


async def serving(replicas: Replicas) -> int:
    """Replicas whose unit is active and whose port no switch holds, now."""
    from appliance import hold

    units = list(replicas.units)
    argv = ["systemctl", *(["--user"] if replicas.user else []), "show", "-p", "ActiveState"]
    proc = await asyncio.create_subprocess_exec(
        *argv, *units, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    out, _ = await proc.communicate()
    active_states = [line.split("=", 1)[1] for line in out.decode().split("\n") if "=" in line]
    mark = hold.read_mark(replicas.state_dir)
    return sum(
        active_state == "active" and not (mark is not None and mark.holds(replicas.units[unit]))
        for unit, active_state in zip(units, active_states, strict=False)
    )


async def watch_capacity(replicas: Replicas, stop: asyncio.Event, report: Report) -> None:
    while not stop.is_set():
        report.capacity.append(await serving(replicas))
        await asyncio.sleep(0.1)


async def switch(target: Target, runtime: str) -> SwitchRun:
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *target.b70ctl,
        "switch",
        runtime,
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    end = time.monotonic()
    try:
        doc = json.loads(out)
    except ValueError:
        doc = {}
    ok = proc.returncode == 0
    seconds = (doc.get("result") or {}).get("seconds")
    error = None if ok else ((doc.get("error") or {}).get("message") or err.decode()[-500:])
    return SwitchRun(runtime, start, end, ok, seconds, error)


async def run(
    target: Target,
    clients: int,
    switches: int,
    between: tuple[str, str],
    steady_s: float,
    max_tokens: int = 32,
    pause_s: float = 2.0,
    log: Any = None,
    replicas: Replicas | None = None,
    steady_min: int = 0,
    kinds: tuple[str, ...] = DEFAULT_MIX,
) -> Report:
    """Steady load for `steady_s`, and on until `steady_min` requests have succeeded (at most
    ten times `steady_s`: a busy machine serves slowly), then `switches` switches alternating
    over `between`; with `replicas`, the serving capacity sampled while each switch runs."""
    report = Report(clients, steady_s)
    first = await switch(target, between[0])  # start from a known runtime
    if not first.ok:
        raise RuntimeError(f"could not switch to {between[0]} to begin: {first.error}")
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(client_loop(target, i, stop, report, max_tokens, kinds))
        for i in range(clients)
    ]
    try:
        await asyncio.sleep(steady_s)
        deadline = time.monotonic() + 9 * steady_s
        while (
            sum(o.result == "succeeded" for o in report.outcomes) < steady_min
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.2)
        for i in range(switches):
            runtime = between[(i + 1) % 2]
            watching = asyncio.Event()
            watch = replicas and asyncio.create_task(watch_capacity(replicas, watching, report))
            run_ = await switch(target, runtime)
            watching.set()
            if watch:
                await watch
            report.switches.append(run_)
            if log:
                how = "ok" if run_.ok else f"FAILED: {run_.error}"
                log(f"switch {i + 1}/{switches} to {runtime}: {run_.end - run_.start:.1f} s {how}")
            await asyncio.sleep(pause_s)  # the new runtime serves under load before the next
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return report


def target_from_config(
    config_path: str | None, user: bool, between: tuple[str, str] | None = None
) -> tuple[Target, Replicas | None]:
    """The appliance's proxy and b70ctl; with `between` naming replica sets, their replicas."""
    from appliance import config as config_mod
    from appliance.keys import read_key
    from appliance.layout import Scope, layout
    from appliance.units import runtimes

    scope = Scope.USER if user else Scope.SYSTEM
    path = Path(config_path) if config_path else layout(scope).config
    config = config_mod.load(path)
    b70ctl = [config.b70ctl] + (["--user"] if user else []) + ["--config", str(path)]
    names = [n for name in between or () if name in config.groups for n in config.members(name)]
    rts = [config.runtime(n) for n in names]
    model = rts[0].served_model_name if rts else config.proxy.model
    target = Target(runtimes.proxy_url(config), read_key(layout(scope)), model, b70ctl)
    if not rts:
        return target, None
    return target, Replicas({rt.unit: rt.port for rt in rts}, user, layout(scope).state_dir)


def render_summary(s: dict[str, Any]) -> str:
    lines = [
        f"{s['clients']} clients, {len(s['switches'])} switches ({s['switches_failed']} failed)"
    ]
    lines.append(
        f"{'':18}{'sent':>7}{'ok':>7}{'failed':>8}{'truncated':>11}{'p50 s':>9}{'p99 s':>9}"
    )
    for name in ("steady_phase", "outside_switches", "during_switches", "all"):
        g = s[name]
        p50 = "-" if g["p50_s"] is None else f"{g['p50_s']:.3f}"
        p99 = "-" if g["p99_s"] is None else f"{g['p99_s']:.3f}"
        lines.append(
            f"{name.replace('_', ' '):18}{g['sent']:>7}{g['succeeded']:>7}{g['failed']:>8}"
            f"{g['truncated']:>11}{p50:>9}{p99:>9}"
        )
    for sw in s["switches"]:
        took = sw["end"] - sw["start"]
        lines.append(f"  switch to {sw['target']}: {took:.1f} s" + ("" if sw["ok"] else " FAILED"))
    if s["capacity"]["samples"]:
        c = s["capacity"]
        lines.append(
            f"  replicas serving during the switches: lowest {c['lowest']}, highest "
            f"{c['highest']} ({c['samples']} samples)"
        )
    for error, count in s["errors"].items():
        lines.append(f"  {count} x {error}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--switches", type=int, default=4)
    parser.add_argument("--between", nargs=2, default=["llamacpp", "vllm"], metavar="RUNTIME")
    parser.add_argument("--steady-s", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--config", help="the appliance's config (default: the installed one)")
    parser.add_argument("--user", action="store_true", help="the appliance of a user manager")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    target, replicas = target_from_config(args.config, args.user, tuple(args.between))

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    report = asyncio.run(
        run(
            target,
            args.clients,
            args.switches,
            (args.between[0], args.between[1]),
            args.steady_s,
            args.max_tokens,
            log=log,
            replicas=replicas,
        )
    )
    summary = report.summary()
    print(json.dumps(summary, indent=2) if args.json else render_summary(summary))
    bad = summary["all"]["failed"] + summary["all"]["truncated"] + summary["switches_failed"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
