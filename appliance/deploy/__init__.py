"""Putting the appliance in place and taking it away: `b70ctl install` and `uninstall`
(`install`), and what `uninstall --purge` removes from the state directory (`purge`).

May import: every room but `watch`, `cli` and `proxy`.
"""
