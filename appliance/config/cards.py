"""The config's cards: `[gpu] cards` and each runtime's `cards`, and the rule that runtimes which
cannot yet serve side by side share a card (appliance.placement uses what is read here)."""

from __future__ import annotations

from collections.abc import Mapping
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

    def together(self, runtimes: Mapping[str, RuntimeConfig]) -> None:
        """Every two runtimes share a card. Runtimes on disjoint cards would serve at the same
        time, each on a port of its own behind its own deployment; until the proxy routes to
        several runtimes, they all listen on [backend] port and so must exclude each other."""
        names = sorted(runtimes)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if not set(runtimes[a].card_indices) & set(runtimes[b].card_indices):
                    raise self.fail(
                        f"runtimes.{b}.cards",
                        f"shares no card with runtimes.{a}, so both would serve at once; "
                        "runtimes serving side by side are not supported yet",
                        "give every two runtimes a card in common (they then take turns)",
                    )

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
