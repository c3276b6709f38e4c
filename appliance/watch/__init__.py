"""Watching the appliance while it runs: `b70ctl monitor` (`monitor`, which heals a hung runtime
through the switch's lock), its Prometheus `metrics`, its ring of `samples` on disk, the status
page (`statuspage`) and `b70ctl status` (`status`).

May import: every room but `deploy`, `cli` and `proxy`.
"""
