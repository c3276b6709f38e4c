"""Where runtimes serve: each one's port and the name it serves, and the peer appliances whose
proxies serve the same names (for the reader of the whole file)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from appliance.config.model import (
    BackendConfig,
    MonitorConfig,
    PeersConfig,
    ProxyConfig,
    RuntimeConfig,
)
from appliance.config.values import (
    HOUR_S,
    check_host,
    check_model_name,
    check_peer_url,
    check_port,
    check_range,
    hosts_overlap,
)
from appliance.config.walk import Walker


class ServingKeys(Walker):
    """The keys about where runtimes serve."""

    def runtime_ports(
        self,
        runtimes: Mapping[str, RuntimeConfig],
        host: str,
        sections: Mapping[str, ProxyConfig | MonitorConfig],
    ) -> None:
        """No runtime listens where the proxy or the monitor does."""
        for rt in runtimes.values():
            for name, section in sections.items():
                if rt.port == section.port and hosts_overlap(host, section.host):
                    raise self.fail(
                        f"runtimes.{rt.name}.port",
                        f"{rt.port} is also {name}.port",
                        "give the runtime another port (runtimes.NAME.port, or [backend] port)",
                    )

    def served(
        self, rt: RuntimeConfig, t: Mapping[str, Any], proxy: ProxyConfig, backend: BackendConfig
    ) -> RuntimeConfig:
        """Where a runtime listens and the name it serves: its own, else the appliance's."""
        p = f"runtimes.{rt.name}."
        name = self.get(t, "served_model_name", p, str, proxy.model, check_model_name)
        if name in proxy.aliases:
            raise self.fail(
                p + "served_model_name",
                f"{name!r} is one of proxy.aliases, which name {proxy.model!r}",
                "choose a name of its own, or drop it from proxy.aliases",
            )
        port = self.get(t, "port", p, int, backend.port, check_port)
        return dataclasses.replace(rt, port=port, served_model_name=name)

    def peers(self, t: Mapping[str, Any], proxy: ProxyConfig) -> PeersConfig:
        p = "peers."
        self.known(t, p, {"urls", "redis_host", "redis_port", "cooldown_s"})
        urls = self.strings(t, "urls", p)
        for i, url in enumerate(urls):
            if problem := check_peer_url(url):
                raise self.fail(f"{p}urls[{i}]", problem, 'e.g. urls = ["http://10.0.0.2:8000"]')
            if url in urls[:i]:
                raise self.fail(f"{p}urls[{i}]", f"{url} is listed twice")
            if not proxy.pass_through:
                raise self.fail(
                    p + "urls", "peers need proxy.pass_through (the door sends them requests)"
                )
        redis = self.get(t, "redis_host", p, str, "", check_host) or None
        if redis is not None and not urls:
            raise self.fail(p + "redis_host", "is for front doors with peers: list peers.urls")
        return PeersConfig(
            urls=urls,
            redis_host=redis,
            redis_port=self.get(t, "redis_port", p, int, 6379, check_port),
            cooldown_s=self.get(
                t, "cooldown_s", p, float, 5.0, check_range(0, HOUR_S, low_open=True)
            ),
        )
