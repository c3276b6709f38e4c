"""The systemd units: rendering them from the config (`render`, with each unit's `sandbox` and
each runtime's command line in `runtimes`), what was last rendered (`rendered`), the one module
that talks to systemd (`systemd`), which runtime serves and waiting for units (`serving`), and
the guards every runtime unit runs around its main process (`guards`: `b70ctl unit pre/ready`).

May import: the core modules, `config` and `host`.
"""
