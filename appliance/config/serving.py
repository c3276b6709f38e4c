"""Where runtimes serve: each one's port and the name it serves, the peer appliances whose
proxies serve the same names, and [switching], which says whether a request may switch its
runtime in (for the reader of the whole file)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from appliance.config.model import (
    ORDERS,
    BackendConfig,
    MonitorConfig,
    PeersConfig,
    ProxyConfig,
    RuntimeConfig,
    SwitchingConfig,
)
from appliance.config.values import (
    DAY_S,
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
    """The keys about where runtimes serve, and the monitor's [monitor]."""

    def monitor(self, t: Mapping[str, Any], names: set[str]) -> MonitorConfig:
        p = "monitor."
        allowed = {
            "host",
            "port",
            "interval_s",
            "health_timeout_s",
            "probe_completion",
            "probe_timeout_s",
            "hang_after",
            "restart_tries",
            "fallback",
        }
        self.known(t, p, allowed)
        fallback = self.get(t, "fallback", p, str, "") or None
        if fallback is not None and fallback not in names:
            raise self.fail(p + "fallback", f"{fallback!r} is not a configured runtime")
        return MonitorConfig(
            host=self.get(t, "host", p, str, "127.0.0.1", check_host),
            port=self.get(t, "port", p, int, 9101, check_port),
            interval_s=self.get(
                t, "interval_s", p, float, 5.0, check_range(0, HOUR_S, low_open=True)
            ),
            health_timeout_s=self.get(
                t, "health_timeout_s", p, float, 5.0, check_range(0, 600, low_open=True)
            ),
            probe_completion=self.get(t, "probe_completion", p, bool, True),
            probe_timeout_s=self.get(
                t, "probe_timeout_s", p, float, 30.0, check_range(0, HOUR_S, low_open=True)
            ),
            hang_after=self.get(t, "hang_after", p, int, 3, check_range(1, 1000)),
            restart_tries=self.get(t, "restart_tries", p, int, 2, check_range(0, 100)),
            fallback=fallback,
        )

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
        self.known(
            t, p, {"urls", "redis_host", "redis_port", "redis_tls", "redis_ca", "cooldown_s", "ca"}
        )
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
        tls = self.get(t, "redis_tls", p, bool, False)
        if tls and redis is None:
            raise self.fail(p + "redis_tls", "is for a shared Redis: set peers.redis_host")
        redis_ca = self.path_value(t, "redis_ca", p, "/") if "redis_ca" in t else None
        if redis_ca is not None and not tls:
            raise self.fail(p + "redis_ca", "is for a Redis that speaks TLS: set redis_tls = true")
        ca = self.path_value(t, "ca", p, "/") if "ca" in t else None
        if ca is not None and not any(u.startswith("https://") for u in urls):
            raise self.fail(p + "ca", "is for https:// peers: list one in peers.urls")
        return PeersConfig(
            urls=urls,
            ca=ca,
            redis_host=redis,
            redis_port=self.get(t, "redis_port", p, int, 6379, check_port),
            redis_tls=tls,
            redis_ca=redis_ca,
            cooldown_s=self.get(
                t, "cooldown_s", p, float, 5.0, check_range(0, HOUR_S, low_open=True)
            ),
        )

    def switching(
        self, t: Mapping[str, Any], proxy: ProxyConfig, runtimes: Mapping[str, RuntimeConfig]
    ) -> SwitchingConfig:
        p = "switching."
        keys = {"on_demand", "order", "max_wait_s", "stay_factor", "batch", "idle_return_s"}
        keys |= {"backoff_s", "fcfs"}
        self.known(t, p, keys)
        idle = self.get(t, "idle_return_s", p, float, 0.0, check_range(0, DAY_S))
        order = self.get(t, "order", p, str, "policy")
        if order not in ORDERS:
            raise self.fail(
                p + "order", f"{order!r} is not an order", "one of " + ", ".join(map(repr, ORDERS))
            )
        if self.get(t, "fcfs", p, bool, False):
            if "order" in t and order != "fcfs":
                raise self.fail(
                    p + "fcfs", f"says first come, first served where order is {order!r}",
                    "keep one of them: order = \"fcfs\" is what fcfs = true meant",
                )  # fmt: skip
            order = "fcfs"
        out = SwitchingConfig(
            on_demand=self.get(t, "on_demand", p, bool, False),
            order=order,
            max_wait_s=(
                self.get(t, "max_wait_s", p, float, 0.0, check_range(0, HOUR_S))
                if "max_wait_s" in t
                else None
            ),
            stay_factor=self.get(t, "stay_factor", p, float, 0.0, check_range(0, 100)),
            batch=self.get(t, "batch", p, int, 0, check_range(0, 100_000)),
            idle_return_s=idle or None,
            backoff_s=self.get(t, "backoff_s", p, float, 60.0, check_range(0, HOUR_S)),
        )
        if (order != "policy" or "order" in t or "fcfs" in t) and not out.on_demand:
            key = "order" if "order" in t else "fcfs"
            raise self.fail(p + key, "is the order of switching on demand", "add on_demand = true")
        if not out.on_demand:
            return out
        ports = {rt.port for rt in runtimes.values()}
        if len(ports) < 2:
            raise self.fail(
                p + "on_demand",
                f"every runtime serves {proxy.model!r} on port {ports.pop()}: a request never "
                "waits for a runtime that does not serve",
                "give another runtime its own served_model_name and port, or drop on_demand",
            )
        if out.max_wait_s is not None and out.max_wait_s >= proxy.hold_s:
            raise self.fail(
                p + "max_wait_s",
                f"{out.max_wait_s:g} s is not below proxy.hold_s ({proxy.hold_s:g} s): a request "
                "would be answered 503 before its turn came",
                f"raise proxy.hold_s above max_wait_s plus a switch's time, e.g. hold_s = "
                f"{out.max_wait_s + 180:g}",
            )
        return out
