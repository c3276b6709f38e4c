"""`b70ctl switch`: the lock, the recovery of a killed switch, then one runtime's switch
(appliance.switch.executor) or a rolling one over a replica set (appliance.switch.rolling)."""

from __future__ import annotations

from appliance.config import Config
from appliance.layout import Scope, layout
from appliance.switch import plans
from appliance.switch.executor import Switch, SwitchResult, SystemClock
from appliance.switch.interrupts import Interrupts
from appliance.switch.lock import switch_lock
from appliance.switch.recovery import recover_killed
from appliance.switch.rolling import rolling
from appliance.units import systemd
from appliance.units.serving import Progress, no_progress


def switch(
    config: Config,
    scope: Scope,
    target_name: str,
    restart: bool = False,
    progress: Progress = no_progress,
    gate: bool = False,
    drain_s: float | None = None,
    reason: str = "by hand",
) -> SwitchResult:
    """The switch, in the steps docs/switch.md numbers:

    1. lock; 2. preflight; 3. hold new requests at the proxy; 4. drain the old runtime;
    5. one StartUnit (Conflicts= stops the old one); 6. verify through the proxy (and gate);
    7. release the hold, enable the target, record. A failure in 5 or 6 rolls back, still held.
    """
    lay = layout(scope)
    names = config.members(target_name)  # a replica set: its replicas, one card at a time
    clock = SystemClock()
    drain_for = config.proxy.drain_s if drain_s is None else drain_s
    options = plans.Options(restart, gate, drain_for, reason)
    with (
        switch_lock(lay.state_dir, target_name) as lock,
        systemd.connect(scope) as sd,
        Interrupts(progress) as interrupts,
    ):
        if lock.stale is not None:
            recover_killed(config, lay, sd, lock.stale, progress, wait=True)
            lock.clear_stale()
        one = Switch(config, lay, sd, lock, interrupts, clock, options)
        if names == (target_name,):
            return one(target_name)
        return rolling(one, target_name, names)
