"""The host: the machine the appliance runs on, as it is. Its GPUs and their memory (`gpu/`), which
cards each runtime runs on (`placement`), processes and who listens on a port (`processes`),
whether a server answers (`health`), whether a model file is whole (`modelfiles`) and whether a
runtime's user may open it (`access`), and `b70ctl doctor`, which checks all of it.

Reads the machine and decides nothing about units or switches. May import: the core modules
(`appliance.errors`, `files`, `hold`, `keys`, `layout`, `run`, `sizes`) and `config`.
"""
