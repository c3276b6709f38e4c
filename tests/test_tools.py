"""The tools' pieces that can be checked without running a benchmark."""

from __future__ import annotations

from appliance import render, runtimes
from appliance.layout import Scope, layout
from b70tools import bench_proxy


def test_the_proxy_bench_sends_the_proxy_to_its_stand_in() -> None:
    """bench-proxy's proxy must reach the stand-in runtime on its port, or every request
    through it waits out the hold and fails."""
    cfg = bench_proxy.appliance_config(18000, 18001, 2)
    assert cfg.proxy.port == 18000 and cfg.proxy.workers == 2
    assert {rt.port for rt in cfg.runtimes.values()} == {18001}
    assert runtimes.backend_url(cfg) == "http://127.0.0.1:18001"
    proxy_config = render.render_proxy_config(cfg, layout(Scope.USER))
    assert 'api_base: "http://127.0.0.1:18001/v1"' in proxy_config
