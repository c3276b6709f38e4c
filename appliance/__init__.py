"""The b70 appliance: vLLM and llama.cpp under systemd behind a LiteLLM proxy.

Each package here is a room, and its __init__ says what it is for and what it may import
(tests/test_rooms.py holds that). The modules at this level are the core every room stands on:
apis, errors, files, hold, keyorder, keys, layout, people, run and usage. They import only each
other and the standard library at their top.
"""

__version__ = "0.1.0"

# The sizes the appliance counts memory in (MiB, GiB: powers of two), here alone, so that a GiB
# is the same in the config, the GPU-memory guard and the plan.
MIB = 1024**2
GIB = 1024**3
