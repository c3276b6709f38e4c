"""Which cards each runtime runs on, and how each engine is told so.

A runtime names its cards by index into the appliance's card list (`[gpu] cards`): the PCI
addresses given there, or with "auto" every B70 of the box in PCI address order. A config that
names no cards anywhere is not placed: every runtime is on "the card" and its unit renders as it
always did, with no device selection at all.

Placed runtimes are told their cards the way each engine honours:
- Level Zero numbers the GPUs it finds; with ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 in PCI address order
  (Level Zero specification, "Environment Variables"). A card's ordinal is therefore its place
  among the box's Intel GPUs (xe or i915) sorted by PCI address, integrated graphics included.
- vLLM on XPU sees the cards in ZE_AFFINITY_MASK (comma-separated ordinals, renumbered from 0 in
  the process), and runs one worker per card with `--tensor-parallel-size N`; one mask for the
  whole process, never one per worker (vLLM's XPU platform and docs/getting_started/installation/
  gpu/xpu.inc.md).
- llama.cpp built with SYCL sees the cards in ONEAPI_DEVICE_SELECTOR=level_zero:A,B (llama.cpp
  docs/backend/SYCL.md); on several it splits the layers over them (its default --split-mode).
- A container gets only its cards' own nodes (/dev/dri/renderDN and /dev/dri/cardN, under the
  host's names, which the sysfs the container sees still names), and /dev/dri/by-path, through
  which Intel's compute runtime finds the render nodes and oneCCL maps cards for collectives
  (vLLM's XPU docker example mounts it). Inside, its cards are ordinals 0..N-1.

Two runtime units exclude each other (`Conflicts=`) exactly when their cards intersect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.config import Config, Engine, Launcher, RuntimeConfig
from appliance.config.model import PCI_ORDER_ENV, SYCL_SELECTOR_ENV, VLLM_MASK_ENV
from appliance.errors import ConfigError

if TYPE_CHECKING:  # the GPU package is read only when a config names cards
    from appliance.host.gpu.sysfs import Device

AUTO = "auto"
BY_PATH = "/dev/dri/by-path"
LEVEL_ZERO_DRIVERS = frozenset({"xe", "i915"})


@dataclass(frozen=True)
class Card:
    """One card of [gpu] cards: its place in the list, PCI address, ordinal and DRM nodes."""

    index: int  # in the appliance's card list
    pci: str
    ordinal: int  # Level Zero's number for it on the host, in PCI order
    card: str | None  # sysfs / device node names: card1, renderD128
    render: str | None


@dataclass(frozen=True)
class Selection:
    """What a placed runtime's unit adds: environment, engine arguments, container options."""

    env: Mapping[str, str]
    args: tuple[str, ...]
    devices: tuple[str, ...]
    volumes: tuple[str, ...]


def is_placed(config: Config) -> bool:
    """Whether the config names cards: [gpu] cards, or a runtime's cards."""
    return config.gpu.cards is not None or any(
        rt.cards is not None for rt in config.runtimes.values()
    )


def excludes(a: RuntimeConfig, b: RuntimeConfig) -> bool:
    """Whether two runtimes need a card in common, so that one must stop for the other."""
    return bool(set(a.card_indices) & set(b.card_indices))


def card_list(config: Config, devices: Sequence[Device]) -> list[Card]:
    """The appliance's cards on this machine, in the order runtimes index them."""
    ordinals = {
        d.pci_slot: i
        for i, d in enumerate(
            sorted(
                (d for d in devices if d.is_intel and d.driver in LEVEL_ZERO_DRIVERS),
                key=lambda d: d.pci_slot,
            )
        )
    }
    by_slot = {d.pci_slot: d for d in devices}
    wanted = config.gpu.cards
    if wanted is None:
        wanted = AUTO if config.gpu.device == AUTO else (config.gpu.device,)
    if wanted == AUTO:
        slots = sorted(d.pci_slot for d in devices if d.is_b70 and d.pci_slot in ordinals)
    else:
        slots = list(wanted)
        for i, slot in enumerate(slots):
            if slot not in ordinals:
                what = "no GPU" if slot not in by_slot else "not an Intel GPU under xe or i915"
                raise ConfigError(
                    f"{config.path}: gpu.cards[{i}]: {slot} is {what} on this machine",
                    hint="`b70ctl gpu` lists the GPUs and their PCI addresses",
                )
    return [
        Card(i, slot, ordinals[slot], by_slot[slot].card, by_slot[slot].render_node)
        for i, slot in enumerate(slots)
    ]


def cards_of(config: Config, runtime: RuntimeConfig, cards: Sequence[Card]) -> list[Card]:
    out = []
    for i in runtime.card_indices:
        if i >= len(cards):
            found = "auto found no B70" if not cards else f"it has {len(cards)} card(s)"
            raise ConfigError(
                f"{config.path}: runtimes.{runtime.name}.cards: card {i} is not in the "
                f"appliance's card list: {found}",
                hint="`b70ctl gpu` lists the GPUs; name them in [gpu] cards, or index from 0",
            )
        out.append(cards[i])
    return out


def placements(
    config: Config, devices: Sequence[Device] | None = None
) -> dict[str, list[Card]] | None:
    """Each runtime's cards on this machine (its sysfs, unless `devices` are given), or None
    when the config names no cards."""
    if not is_placed(config):
        return None
    if devices is None:
        from appliance.host.gpu import sysroot
        from appliance.host.gpu.sysfs import read_devices

        devices = read_devices(sysroot())
    cards = card_list(config, devices)
    return {name: cards_of(config, rt, cards) for name, rt in sorted(config.runtimes.items())}


def devices_of(config: Config, runtime: RuntimeConfig, cards: Sequence[Card] | None) -> list[str]:
    """The cards whose free memory `runtime`'s start waits for: its own placed cards (their PCI
    addresses), or `[gpu] device` when the config names no cards."""
    return [c.pci for c in cards] if cards else [config.gpu.device]


def selection(runtime: RuntimeConfig, cards: Sequence[Card]) -> Selection:
    """How `runtime`'s engine and launcher are told to use `cards`, and only them."""
    container = runtime.launcher is not Launcher.NATIVE
    ordinals = list(range(len(cards))) if container else [c.ordinal for c in cards]
    listed = ",".join(str(o) for o in ordinals)
    env = {PCI_ORDER_ENV: "1"}
    args: tuple[str, ...] = ()
    if runtime.engine is Engine.VLLM:
        env[VLLM_MASK_ENV] = listed
        if len(cards) > 1:
            args = ("--tensor-parallel-size", str(len(cards)))
    else:
        env[SYCL_SELECTOR_ENV] = f"level_zero:{listed}"
    devices: tuple[str, ...] = ()
    volumes: tuple[str, ...] = ()
    if container:
        nodes = [f"/dev/dri/{n}" for c in cards for n in (c.render, c.card) if n]
        devices, volumes = tuple(nodes), (f"{BY_PATH}:{BY_PATH}:ro",)
    return Selection(env, args, devices, volumes)


def describe(cards: Sequence[Card]) -> str:
    """`card 0 (0000:03:00.0)`, `cards 0-1 (0000:03:00.0, 0000:04:00.0)`."""
    indices = [c.index for c in cards]
    if len(indices) == 1:
        label = f"card {indices[0]}"
    elif indices == list(range(indices[0], indices[-1] + 1)):
        label = f"cards {indices[0]}-{indices[-1]}"
    else:
        label = "cards " + ",".join(str(i) for i in indices)
    return f"{label} ({', '.join(c.pci for c in cards)})"
