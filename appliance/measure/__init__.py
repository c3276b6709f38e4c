"""Measuring a runtime: `b70ctl bench`, the validity gates (`gate`: `b70ctl gate` and `switch
--gate`), and `b70ctl plan`'s memory arithmetic (`capacity`, `paging`, `shape`, and `measured`,
which compares it with what a running vLLM reports).

May import: the core modules, `config`, `host` and `units`.
"""
