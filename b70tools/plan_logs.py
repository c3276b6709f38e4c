"""scripts/plan-logs: `b70ctl plan` beside each B70 log of b70tools.b70logs, as a table."""

from __future__ import annotations

import json
from pathlib import Path

from appliance.measure import capacity, serveflags
from b70tools.b70logs import GIB, LOGS, RELEASES, WEIGHTS

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "b70"


def main() -> None:
    print(f"{'log':<5}{'tokens logged':>15}{'planned':>10}{'conc logged':>13}{'planned':>9}"
          f"{'avail logged':>14}{'from flags':>12}{'apart':>8}{'weights':>9}"
          f"{'planned':>9}{'w/ logged weights':>19}{'apart':>8}")  # fmt: skip
    for name, config, flags, available, tokens, concurrency, *_ in LOGS:
        cfg = json.loads((FIXTURES / f"{config}.json").read_text())
        serve = serveflags.parse(flags)
        release = capacity.parse_version(RELEASES[name])
        given = capacity.plan(cfg, serve, cache_bytes=int(available * GIB), vllm_version=release)
        alone = capacity.plan(cfg, serve, vllm_version=release)
        logged_w = WEIGHTS.get(name)
        weighed = (
            capacity.plan(
                cfg, serve, weights_per_card=int(logged_w * GIB), vllm_version=release
            ).available_kv_bytes
            / GIB if logged_w is not None else None
        )  # fmt: skip
        print(
            f"{name:<5}{tokens:>15,}{given.kv_cache_tokens:>10,}"
            f"{concurrency if concurrency is not None else '-':>13}{given.max_concurrency:>9.2f}"
            f"{available:>14.2f}{alone.available_kv_bytes / GIB:>12.2f}"
            f"{alone.available_kv_bytes / GIB / available - 1:>+8.1%}"
            f"{logged_w if logged_w is not None else '-':>9}"
            f"{alone.weight_bytes_per_card / GIB:>9.2f}"
            + (f"{weighed:>19.2f}{weighed / available - 1:>+8.1%}" if weighed else "")
        )


if __name__ == "__main__":
    main()
