"""The tools' pieces that can be checked without running a benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.layout import Scope, layout
from appliance.units import render, runtimes
from b70tools import bench_proxy, proxy_phases


def test_the_proxy_bench_sends_the_proxy_to_its_stand_in() -> None:
    """bench-proxy's proxy must reach the stand-in runtime on its port, or every request
    through it waits out the hold and fails."""
    cfg = bench_proxy.appliance_config(18000, 18001, 2)
    assert cfg.proxy.port == 18000 and cfg.proxy.workers == 2
    assert {rt.port for rt in cfg.runtimes.values()} == {18001}
    assert runtimes.backend_url(cfg) == "http://127.0.0.1:18001"
    proxy_config = render.render_proxy_config(cfg, layout(Scope.USER))
    assert 'api_base: "http://127.0.0.1:18001/v1"' in proxy_config


def test_a_bursts_phases_are_each_steps_time_after_the_one_before(tmp_path: Path) -> None:
    """bench-proxy --parts phases: the client's, the workers' and the runtime's notes of each
    request, on one clock, split into steps; which worker took how many; the collections."""

    def note(worker: int, record: dict[str, float]) -> None:
        with (tmp_path / f"{worker}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    runs, runtime = [], {}
    for n, worker in ((1, 100), (2, 100), (3, 200)):
        # a millisecond a step inside the worker, the runtime 2 ms to read the request
        at = {name: 10.0 * n + 0.001 * i for i, name in enumerate(proxy_phases.STEPS)}
        runtime[str(n)] = {
            "arrived": at["connected"] + 0.002,
            "first_write": at["connected"] + 0.003,
        }
        at["first_out"] = at["connected"] + 0.004
        note(worker, {"n": n, **at})
        runs.append({"n": n, "sent": 10.0 * n - 0.001, "first": at["first_out"] + 0.004})
    runs.append({"n": 4, "sent": 0.0, "first": None})  # unanswered: left out
    note(200, {"gc": 2, "start": 5.0, "took_s": 0.0042})

    split = proxy_phases.split(runs, runtime, tmp_path)

    assert split["requests"] == 3
    assert split["sent->accepted_ms"] == pytest.approx(1.0)
    assert split["accepted->parsed_ms"] == pytest.approx(1.0)
    assert split["let_through->connected_ms"] == pytest.approx(1.0)
    assert split["connected->arrived_ms"] == pytest.approx(2.0)
    assert split["arrived->first_write_ms"] == pytest.approx(1.0)
    assert split["first_write->first_out_ms"] == pytest.approx(1.0)
    assert split["first_out->first_ms"] == pytest.approx(4.0)
    assert split["most_to_one_worker"] == 2
    assert (split["collections"], split["longest_collection_ms"]) == (1, pytest.approx(4.2))
    proxy_phases.forget(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_test_ports_keep_out_of_the_range_for_outgoing_connections() -> None:
    """A test's port is taken from below the kernel's range for outgoing connections, so that
    none of the connections a run makes takes it before its server binds it (a replica's start
    failed so in CI); a block of consecutive ports for replicas, none handed out twice."""
    from appliance.host.processes import ephemeral_range
    from b70tools import net

    span = ephemeral_range()
    assert span is not None
    firsts = [net.free_ports(4) for _ in range(50)]
    ports = [first + i for first in firsts for i in range(4)]
    assert len(set(ports)) == len(ports), "no port twice"
    assert all(net.LOWEST <= p < span[0] for p in ports)
    assert all(net.bindable(p) for p in ports)
