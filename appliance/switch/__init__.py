"""A switch, decided and applied. `plans` decides, as pure functions of what was observed;
`apply` is `b70ctl switch` (the lock, recovery of a killed switch, then one runtime or a rolling
set); `executor` applies a plan's steps through `edges` (systemd, the proxy's hold, the records);
`preflight` checks before anything is touched; `interrupts` collects SIGINT and SIGTERM at safe
points; `recovery` mends a killed switch; `lock` and `records` are what a switch keeps in the
state directory.

May import: the core modules, `config`, `host`, `units` and `measure` (a switch's gates).
"""
