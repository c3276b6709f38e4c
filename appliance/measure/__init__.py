"""Measuring a runtime: `b70ctl bench`, the validity gates (`gate`: `b70ctl gate` and `switch
--gate`), and `b70ctl plan`'s memory arithmetic (`capacity`, `paging`, `shape`, `quant`, from
vLLM's flags: `serveflags`; its start-up lines: `startlog`; a runtime's plan and the check that
it fits: `recipe`; and `measured`, which compares it with what a running vLLM reports).

May import: the core modules, `config`, `host` and `units`.
"""
