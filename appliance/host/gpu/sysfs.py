"""Intel GPUs from sysfs (/sys/class/drm/cardN/device: vendor, device, uevent, driver)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

INTEL_VENDOR = 0x8086
# BMG-G31 (Arc Pro B70 is e223); the xe driver binds them.
B70_DEVICE_IDS = frozenset({0xE220, 0xE221, 0xE222, 0xE223})
KNOWN_NAMES = {0xE223: "Intel Arc Pro B70"}


@dataclass(frozen=True)
class Device:
    """An Intel GPU as sysfs shows it: PCI slot, ids, driver and DRM nodes."""

    pci_slot: str
    vendor_id: int
    device_id: int
    driver: str | None
    card: str | None
    render_node: str | None

    @property
    def is_intel(self) -> bool:
        return self.vendor_id == INTEL_VENDOR

    @property
    def is_b70(self) -> bool:
        return self.is_intel and self.device_id in B70_DEVICE_IDS

    @property
    def name(self) -> str | None:
        return KNOWN_NAMES.get(self.device_id) if self.is_intel else None


def parse_uevent(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def read_text(path: Path) -> str | None:
    """A small kernel file's text, or None when it cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return None


def _hex(text: str | None) -> int | None:
    try:
        return int(text.strip(), 16) if text else None
    except ValueError:
        return None


def read_devices(root: Path = Path("/")) -> list[Device]:
    """Every DRM card under root/sys/class/drm with its PCI identity (Intel or not)."""
    drm = root / "sys" / "class" / "drm"
    if not drm.is_dir():
        return []
    renders: dict[str, str] = {}
    cards: dict[str, str] = {}
    for entry in sorted(drm.iterdir()):
        if re.fullmatch(r"renderD\d+", entry.name):
            slot = _pci_slot(entry / "device")
            if slot:
                renders.setdefault(slot, entry.name)
        elif re.fullmatch(r"card\d+", entry.name):
            slot = _pci_slot(entry / "device")
            if slot:
                cards.setdefault(slot, entry.name)
    devices = []
    for slot, card in sorted(cards.items()):
        dev = drm / card / "device"
        vendor, device = _hex(read_text(dev / "vendor")), _hex(read_text(dev / "device"))
        if vendor is None or device is None:
            continue
        uevent = parse_uevent(read_text(dev / "uevent") or "")
        devices.append(Device(slot, vendor, device, uevent.get("DRIVER"), card, renders.get(slot)))
    return devices


def _pci_slot(device_dir: Path) -> str | None:
    uevent = parse_uevent(read_text(device_dir / "uevent") or "")
    slot = uevent.get("PCI_SLOT_NAME")
    if slot:
        return slot
    try:
        name = os.readlink(device_dir).rstrip("/").rsplit("/", 1)[-1]
    except OSError:
        return None
    return name if re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", name) else None
