"""Level Zero Sysman through pyzes: device memory per PCI address, when it is installed.

An optional source (`pip install b70-appliance[sysman]`, plus Intel's Level Zero loader,
libze_loader.so.1). It reads the same xe query as gpu.xe.query_mem_regions, so it adds a second
opinion and a path for machines where the ioctl cannot be made; without CAP_PERFMON its `free`
equals `size`, which is reported as used unknown.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SysmanMemory:
    pci_slot: str
    total_bytes: int
    used_bytes: int | None


@dataclass(frozen=True)
class SysmanResult:
    memory: dict[str, SysmanMemory]
    unavailable: str | None  # why there is nothing, if there is nothing


def read_sysman() -> SysmanResult:
    try:
        import pyzes
    except ImportError:
        return SysmanResult({}, "pyzes is not installed")
    except Exception as e:  # pyzes loads libze_loader.so.1 on import and raises plain Exception
        return SysmanResult({}, f"the Level Zero loader could not be loaded: {e}")
    try:
        return SysmanResult(_read(pyzes), None)
    except RuntimeError as e:
        return SysmanResult({}, f"Level Zero Sysman: {e}")
    except AttributeError as e:  # a loader older than the Sysman-only entry points (zesInit)
        return SysmanResult({}, f"the Level Zero loader lacks a Sysman function: {e}")


def _handles(pyzes: Any, enum: Any, handle_type: Any, *args: Any) -> list[Any]:
    count = ctypes.c_uint32(0)
    _check(enum(*args, ctypes.byref(count), None), enum)
    array = (handle_type * count.value)()
    _check(enum(*args, ctypes.byref(count), array), enum)
    return list(array)


def _check(rc: int, fn: Any) -> None:
    if rc != 0:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} returned {rc:#x}")


def _read(pyzes: Any) -> dict[str, SysmanMemory]:
    _check(pyzes.zesInit(0), pyzes.zesInit)
    out: dict[str, SysmanMemory] = {}
    for driver in _handles(pyzes, pyzes.zesDriverGet, pyzes.zes_driver_handle_t):
        for device in _handles(pyzes, pyzes.zesDeviceGet, pyzes.zes_device_handle_t, driver):
            pci = pyzes.zes_pci_properties_t()
            pci.stype = pyzes.ZES_STRUCTURE_TYPE_PCI_PROPERTIES
            _check(
                pyzes.zesDevicePciGetProperties(device, ctypes.byref(pci)),
                "zesDevicePciGetProperties",
            )
            a = pci.address
            slot = f"{a.domain:04x}:{a.bus:02x}:{a.device:02x}.{a.function:x}"
            total = free = 0
            mems = _handles(pyzes, pyzes.zesDeviceEnumMemoryModules, pyzes.zes_mem_handle_t, device)
            for mem in mems:
                props = pyzes.zes_mem_properties_t()
                props.stype = pyzes.ZES_STRUCTURE_TYPE_MEM_PROPERTIES
                _check(
                    pyzes.zesMemoryGetProperties(mem, ctypes.byref(props)), "zesMemoryGetProperties"
                )
                if props.location != pyzes.ZES_MEM_LOC_DEVICE:
                    continue
                usage = pyzes.zes_mem_state_t()
                usage.stype = pyzes.ZES_STRUCTURE_TYPE_MEM_STATE
                _check(pyzes.zesMemoryGetState(mem, ctypes.byref(usage)), "zesMemoryGetState")
                total += usage.size
                free += usage.free
            if total:
                out[slot] = SysmanMemory(slot, total, None if free == total else total - free)
    return out
