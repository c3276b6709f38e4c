"""`b70ctl gate`: validity gates a runtime must pass before a result or a switch counts.

- JSON mode: K requests ask for an object with a JSON schema (`response_format`); every reply
  must parse and match the schema.
- Canaries: fixed prompts whose greedy answers are recorded per runtime the first time (or with
  --record) and must come back the same afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from appliance import hold as hold_mark
from appliance.config import Config
from appliance.errors import ApplianceError
from appliance.files import write_atomic
from appliance.keys import read_key
from appliance.layout import CANARY_FILE, Layout
from appliance.units import runtimes

CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer"},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population", "is_capital"],
    "additionalProperties": False,
}
JSON_CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Hanoi", "Cairo", "Quito"]
CANARIES = [
    "What is the capital of France? Answer in one word.",
    "Count from one to five in words, separated by commas.",
    "Complete the sentence: The quick brown fox",
]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class GateResult:
    runtime: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> str:
        return "; ".join(f"{c.name}: {c.detail}" for c in self.checks if not c.ok)


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
    "null": (type(None),),
}


def schema_errors(instance: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Errors of `instance` against the subset of JSON Schema the gate uses."""
    kind = schema.get("type")
    if kind:
        ok = isinstance(instance, _TYPES[kind])
        if kind in {"integer", "number"} and isinstance(instance, bool):
            ok = False
        if not ok:
            return [f"{path} is {type(instance).__name__}, not {kind}"]
    errors = []
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in instance:
                errors.append(f"{path}.{key} is missing")
        if schema.get("additionalProperties") is False:
            errors += [f"{path}.{k} is not allowed" for k in instance if k not in props]
        for key, sub in props.items():
            if key in instance:
                errors += schema_errors(instance[key], sub, f"{path}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors


def _chat(client: httpx.Client, model: str, prompt: str, **extra: Any) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        **extra,
    }
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
    return str(r.json()["choices"][0]["message"]["content"] or "")


def check_json_mode(client: httpx.Client, model: str, k: int) -> Check:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
    }
    problems = []
    for city in (JSON_CITIES * (k // len(JSON_CITIES) + 1))[:k]:
        prompt = f"Describe the city of {city} as a JSON object with its country and population."
        try:
            text = _chat(client, model, prompt, max_tokens=200, response_format=response_format)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            problems.append(f"{city}: request failed: {e}")
            continue
        try:
            errors = schema_errors(json.loads(text), CITY_SCHEMA)
        except ValueError:
            problems.append(f"{city}: not JSON: {text[:80]!r}")
            continue
        problems += [f"{city}: {e}" for e in errors]
    detail = f"{k} of {k} replies matched the schema" if not problems else "; ".join(problems[:4])
    return Check("json-mode", not problems, detail)


def check_canaries(
    client: httpx.Client, model: str, runtime: str, path: Path, record: bool
) -> Check:
    try:
        known: dict[str, dict[str, str]] = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        known = {}
    recorded = known.get(runtime, {})
    answers = {}
    for prompt in CANARIES:
        try:
            answers[prompt] = _chat(client, model, prompt, max_tokens=24)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return Check("canaries", False, f"{prompt!r}: request failed: {e}")
    if record or not all(p in recorded for p in CANARIES):
        known[runtime] = answers
        write_atomic(path, json.dumps(known, indent=2, sort_keys=True) + "\n")
        return Check("canaries", True, f"recorded {len(answers)} greedy answers for {runtime}")
    changed = [p for p in CANARIES if answers[p] != recorded[p]]
    if changed:
        first = changed[0]
        return Check(
            "canaries",
            False,
            f"{len(changed)} of {len(CANARIES)} answers changed; {first!r}: "
            f"recorded {recorded[first]!r}, now {answers[first]!r}",
        )
    return Check("canaries", True, f"{len(CANARIES)} of {len(CANARIES)} answers as recorded")


def check(
    base_url: str,
    api_key: str,
    model: str,
    runtime: str,
    state_dir: Path,
    k: int = 4,
    record: bool = False,
    headers: dict[str, str] | None = None,
) -> GateResult:
    result = GateResult(runtime)
    headers = {"Authorization": f"Bearer {api_key}", **(headers or {})}
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        result.checks.append(check_json_mode(client, model, k))
        result.checks.append(
            check_canaries(client, model, runtime, state_dir / CANARY_FILE, record)
        )
    return result


def through_proxy(
    config: Config,
    lay: Layout,
    runtime: str,
    record: bool = False,
    token: str | None = None,
    k: int = 4,
) -> GateResult:
    """The gates through the appliance's proxy, with its key; `token` passes a switch's hold."""
    return check(
        runtimes.proxy_url(config),
        read_key(lay),
        config.runtime(runtime).served_model_name,
        runtime,
        lay.state_dir,
        k,
        record=record,
        headers={hold_mark.BYPASS_HEADER: token} if token else None,
    )


def require(result: GateResult) -> GateResult:
    """The result, if every check passed; else the error naming what failed."""
    if not result.ok:
        raise ApplianceError(
            f"{result.runtime} failed the validity gates: {result.failures()}",
            hint="`b70ctl gate --json` shows every check; `--record` records canaries anew",
            code="gate_failed",
            details={
                "runtime": result.runtime,
                "ok": False,
                "checks": [vars(c) for c in result.checks],
            },
        )
    return result
