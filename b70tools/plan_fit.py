"""scripts/plan-fit: the fitted terms of the plan's budget (appliance.measure.memory.budget), fitted
again from the B70 logs that state their weights, with each log's error when it is left out of
the fit. What it prints is what budget.py's FIT_ and ERROR_ constants and docs/plan.md hold.

Before vLLM 0.26: what is left of each log's budget once the worked-out terms are taken away
(requested - logged weights - logged cache - activations - sampler) is fitted, by least squares
of the relative error,
as base + per sequence x min(--max-num-seqs, 128) + second card x (cards > 1). From 0.26: the one
figure the seed recipe's 61 requests give."""

from __future__ import annotations

import json
from pathlib import Path

from appliance.measure import capacity, serveflags
from appliance.measure.memory import budget
from b70tools.b70logs import GIB, LOGS, RELEASES, SEED, WEIGHTS

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "b70"
WORKED = ("activations", "sampler")


def _config(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def old_rows() -> list[tuple[str, list[float], float, float]]:
    """Each log before 0.26 that states its weights: its name, its fitted terms' columns, what
    they must hold (GiB) and its logged cache (GiB)."""
    rows = []
    for name, config, flags, available, *_ in LOGS:
        if name not in WEIGHTS:
            continue
        serve = serveflags.parse(flags)
        release = capacity.parse_version(RELEASES[name])
        weights = int(WEIGHTS[name] * GIB)
        p = capacity.plan(_config(config), serve, weights_per_card=weights, vllm_version=release)
        worked = sum(t.bytes for t in p.budget.terms if t.key in (*WORKED, "weights"))
        rest = (p.budget.requested - worked) / GIB - available
        seqs = min(serve.max_num_seqs or budget.DEFAULT_MAX_SEQS, budget.FIT_SEQUENCES)
        columns = [1.0, float(seqs), float(serve.tensor_parallel_size > 1)]
        rows.append((name, columns, rest, available))
    return rows


def fit(logged: list[tuple[str, list[float], float, float]]) -> list[float]:
    """Least squares of the relative error (each row over its logged cache, as the plan is
    judged): the normal equations (A'A) x = A'y, solved by elimination."""
    rows = [
        (name, [c / cache for c in cols], rest / cache, cache) for name, cols, rest, cache in logged
    ]
    n = len(rows[0][1])
    m = [[sum(r[1][i] * r[1][j] for r in rows) for j in range(n)] for i in range(n)]
    y = [sum(r[1][i] * r[2] for r in rows) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(m[k][col]))
        m[col], m[pivot], y[col], y[pivot] = m[pivot], m[col], y[pivot], y[col]
        for k in range(n):
            if k != col and m[col][col]:
                f = m[k][col] / m[col][col]
                m[k] = [a - f * b for a, b in zip(m[k], m[col], strict=True)]
                y[k] -= f * y[col]
    return [y[i] / m[i][i] if m[i][i] else 0.0 for i in range(n)]


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def seed_rest() -> tuple[float, float]:
    """What the seed's 61 requests leave for the fitted term from 0.26 on (GiB): the least and
    the most the cache can be while 61 requests of 1,024 tokens fit and 62 do not."""
    config, flags, tokens, fit_at, release = SEED
    serve = serveflags.parse(flags)
    cfg = _config(config)
    version = capacity.parse_version(release)
    p = capacity.plan(cfg, serve, tokens=tokens, vllm_version=version)
    worked = sum(t.bytes for t in p.budget.terms if t.key in (*WORKED, "weights"))
    g = p.paging
    per = g.blocks_per_request * g.group_size * g.page_bytes
    least = (fit_at * g.blocks_per_request + 1) * g.group_size * g.page_bytes
    most = least + per - 1
    return ((p.budget.requested - worked - most) / GIB, (p.budget.requested - worked - least) / GIB)


def main() -> None:
    rows = old_rows()
    coef = fit(rows)
    base, per_seq, second = coef
    print(
        f"before 0.26: base {base:.4f} GiB, per sequence {per_seq:.4f} GiB, "
        f"second card {second:.4f} GiB"
    )
    print(f"{'log':<5}{'cache logged':>14}{'planned':>9}{'apart':>8}{'left out':>10}{'apart':>8}")
    below = above = 0.0
    for i, (name, cols, rest, available) in enumerate(rows):
        planned = available + rest - dot(coef, cols)
        alone = fit(rows[:i] + rows[i + 1 :])
        left_out = available + rest - dot(alone, cols)
        below, above = max(below, left_out - available), max(above, available - left_out)
        print(
            f"{name:<5}{available:>14.2f}{planned:>9.2f}{planned / available - 1:>+8.1%}"
            f"{left_out:>10.2f}{left_out / available - 1:>+8.1%}"
        )
    print(
        f"left out, the cache was up to {below:.2f} GiB smaller than planned (ERROR_BELOW) "
        f"and up to {above:.2f} GiB larger (ERROR_ABOVE)"
    )
    low, high = seed_rest()
    print(
        f"from 0.26: the seed's 61 requests leave {low:.2f} to {high:.2f} GiB for the runtime "
        "(FIT_RUNTIME_NEW)"
    )


if __name__ == "__main__":
    main()
