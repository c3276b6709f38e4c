"""The rolling switch of a replica set (appliance.switch.rolling) on a stand-in for one runtime's switch:
one replica at a time, and on a failure the replicas switched before it put back, last first."""

from __future__ import annotations

import types
from typing import Any

import pytest

from appliance.errors import ApplianceError
from appliance.switch.executor import SwitchResult
from appliance.switch.interrupts import Interrupts
from appliance.switch.rolling import rolling


class OneSwitch:
    """Switches `new-I` in place of `old-I`, or `old-I` back; fails where it is told to."""

    def __init__(self, fail: str | None = None, fail_back: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail, self.fail_back = fail, fail_back
        self.clock = types.SimpleNamespace(monotonic=lambda: 100.0)
        self.interrupts = Interrupts(lambda phase, detail: None)
        names = [f"{g}-{i}" for g in ("old", "new") for i in range(3)]
        runtimes = {n: types.SimpleNamespace(group=n.split("-")[0], unit=f"b70-{n}.service")
                    for n in names}  # fmt: skip
        self.config = types.SimpleNamespace(runtimes=runtimes)
        self.sd: Any = None

    def __call__(self, name: str) -> SwitchResult:
        self.calls.append(name)
        if name == self.fail:
            raise ApplianceError(f"switch to {name} failed: it did not start")
        if name == self.fail_back:
            raise ApplianceError(f"{name} did not start")
        group, index = name.split("-")
        other = f"{'old' if group == 'new' else 'new'}-{index}"
        return SwitchResult(name, other, True, 1.0, {}, [], stopped=[other])


def test_replicas_are_switched_one_card_at_a_time() -> None:
    one = OneSwitch()
    result = rolling(one, "new", ("new-0", "new-1", "new-2"))  # type: ignore[arg-type]
    assert one.calls == ["new-0", "new-1", "new-2"]
    assert (result.target, result.previous, result.ok) == ("new", "old", True)
    assert result.stopped == ["old-0", "old-1", "old-2"]
    assert list(result.phases) == ["new-0", "new-1", "new-2"]


def test_a_replica_that_fails_puts_back_the_ones_switched_before_it() -> None:
    one = OneSwitch(fail="new-2")
    with pytest.raises(ApplianceError) as e:
        rolling(one, "new", ("new-0", "new-1", "new-2"))  # type: ignore[arg-type]
    assert one.calls == ["new-0", "new-1", "new-2", "old-1", "old-0"]
    message = e.value.message
    assert message.startswith("rolling switch to new failed at new-2: switch to new-2 failed")
    assert "rolled back new-1: old-1 serving again" in message
    assert message.index("new-1: old-1") < message.index("new-0: old-0"), "last first"


def test_a_failure_while_putting_back_is_said_and_the_rest_still_put_back() -> None:
    one = OneSwitch(fail="new-2", fail_back="old-1")
    with pytest.raises(ApplianceError) as e:
        rolling(one, "new", ("new-0", "new-1", "new-2"))  # type: ignore[arg-type]
    assert one.calls == ["new-0", "new-1", "new-2", "old-1", "old-0"]
    assert "new-1: putting it back failed: old-1 did not start" in e.value.message
    assert "new-0: old-0 serving again" in e.value.message
