"""The config's cards: `[gpu] cards` and each runtime's `cards`, and the rules for runtimes that
serve side by side (appliance.host.placement uses what is read here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from appliance.config.model import (
    PCI_ORDER_ENV,
    SYCL_SELECTOR_ENV,
    VLLM_MASK_ENV,
    Engine,
    GpuConfig,
    Launcher,
    RuntimeConfig,
)
from appliance.config.values import check_pci_address
from appliance.config.walk import Walker, kind_of

MAX_CARDS = 64


class CardKeys(Walker):
    """The keys about cards, for the reader of the whole file."""

    def side_by_side(self, runtimes: Mapping[str, RuntimeConfig]) -> None:
        """Runtimes on disjoint cards serve at the same time, so each needs a port of its own;
        a port is one deployment behind the proxy, so it serves one name; and runtimes that take
        turns under one name take turns on one port, or the proxy would route to the one that
        is stopped."""
        names = sorted(runtimes)
        for i, a_name in enumerate(names):
            for b_name in names[i + 1 :]:
                a, b = runtimes[a_name], runtimes[b_name]
                turns = bool(set(a.card_indices) & set(b.card_indices))
                if a.port == b.port and not turns:
                    raise self.fail(
                        f"runtimes.{b.name}.port",
                        f"{b.port} is also the port of runtimes.{a.name}, and they share no "
                        "card, so both would serve at once",
                        f"give runtimes.{b.name} a port of its own, e.g. port = {b.port + 1}",
                    )
                if a.port == b.port and a.served_model_name != b.served_model_name:
                    raise self.fail(
                        f"runtimes.{b.name}.served_model_name",
                        f"{b.served_model_name!r} on port {b.port}, where runtimes.{a.name} "
                        f"serves {a.served_model_name!r}: one port serves one name",
                        f"give runtimes.{b.name} a port of its own",
                    )
                if turns and a.served_model_name == b.served_model_name and a.port != b.port:
                    raise self.fail(
                        f"runtimes.{b.name}.port",
                        f"runtimes.{a.name} and runtimes.{b.name} share a card, so they take "
                        f"turns, and both serve {a.served_model_name!r}, but on ports {a.port} "
                        f"and {b.port}",
                        "runtimes that take turns under one name use one port: drop one port",
                    )

    def replicas(
        self, runtimes: Mapping[str, RuntimeConfig], tables: Mapping[str, Any]
    ) -> dict[str, RuntimeConfig]:
        """Each `per_card = true` runtime as one replica per card: NAME-I on card I, on its port
        plus the card's place in its list, under the runtime's name; the rest as they are."""
        out: dict[str, RuntimeConfig] = {}
        for name, rt in runtimes.items():
            p = f"runtimes.{name}."
            if not self.get(tables[name], "per_card", p, bool, False):
                out[name] = rt
                continue
            if rt.cards is None:
                raise self.fail(
                    p + "per_card",
                    "one replica per card needs the cards",
                    "list them: cards = [0, 1, 2, 3] runs four replicas",
                )
            for place, card in enumerate(rt.cards):
                replica = f"{name}-{card}"
                if replica in runtimes or replica in out:
                    raise self.fail(
                        p + "per_card",
                        f"its replica on card {card} would be named {replica!r}, "
                        "which is another runtime's name",
                        "rename one of them",
                    )
                port = rt.port + place
                if port > 65535:
                    raise self.fail(p + "port", f"its replica on card {card} would be on {port}")
                out[replica] = replace(rt, name=replica, cards=(card,), port=port, group=name)
        return out

    def gpu_cards(self, t: Mapping[str, Any], p: str) -> str | tuple[str, ...] | None:
        if "cards" not in t:
            return None
        value = t["cards"]
        if value == "auto":
            return "auto"
        hint = 'PCI addresses as `b70ctl gpu` lists them, e.g. ["0000:03:00.0"], or "auto"'
        if not isinstance(value, list) or not value:
            raise self.fail(
                p + "cards",
                f'must be "auto" or a list of PCI addresses, not '
                f"{kind_of(value) if not isinstance(value, list) else 'an empty list'}",
                hint,
            )
        for i, slot in enumerate(value):
            if not isinstance(slot, str) or slot == "auto" or check_pci_address(slot):
                raise self.fail(f"{p}cards[{i}]", f"{slot!r} is not a PCI address", hint)
            if slot in value[:i]:
                raise self.fail(f"{p}cards[{i}]", f"{slot} is listed twice", hint)
        if len(value) > MAX_CARDS:
            raise self.fail(p + "cards", f"lists {len(value)} cards; at most {MAX_CARDS}")
        return tuple(value)

    def runtime_cards(
        self,
        t: Mapping[str, Any],
        p: str,
        gpu: GpuConfig,
        engine: Engine,
        launcher: Launcher,
        args: tuple[str, ...],
        devices: tuple[str, ...],
        env: Mapping[str, str],
    ) -> tuple[int, ...] | None:
        """A runtime's cards, as indices into [gpu] cards."""
        if "cards" not in t:
            return None
        value = t["cards"]
        hint = "indices into [gpu] cards, from 0: cards = [0], or cards = [0, 1] for two"
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        ):
            raise self.fail(p + "cards", f"must be a list of card indices, not {value!r}", hint)
        for i, index in enumerate(value):
            if not 0 <= index < MAX_CARDS:
                raise self.fail(f"{p}cards[{i}]", f"{index} is not a card index (0-63)", hint)
            if index in value[:i]:
                raise self.fail(f"{p}cards[{i}]", f"card {index} is listed twice", hint)
            if isinstance(gpu.cards, tuple) and index >= len(gpu.cards):
                raise self.fail(
                    f"{p}cards[{i}]",
                    f"card {index} is not in gpu.cards, which lists {len(gpu.cards)}",
                    hint,
                )
        if engine is Engine.VLLM:
            for arg in args:
                if arg.split("=", 1)[0] in ("--tensor-parallel-size", "-tp"):
                    raise self.fail(
                        p + "args",
                        f"sets {arg.split('=', 1)[0]}, which the appliance sets from "
                        f"{p}cards (one worker per card)",
                        "drop it: cards = [0, 1] runs tensor parallel over two cards",
                    )
        for key in (PCI_ORDER_ENV, VLLM_MASK_ENV, SYCL_SELECTOR_ENV):
            if key in env:
                raise self.fail(
                    f"{p}env.{key}",
                    f"the appliance sets {key} from {p}cards",
                    "drop it: cards = [1] puts the runtime on the second card",
                )
        if launcher is not Launcher.NATIVE:
            for i, device in enumerate(devices):
                if device.split(":", 1)[0].rstrip("/").startswith("/dev/dri"):
                    raise self.fail(
                        f"{p}devices[{i}]",
                        f"{device} would give the container cards besides its own",
                        f"drop it: the appliance passes the nodes of {p}cards",
                    )
        return tuple(value)
