"""The b70 appliance: vLLM and llama.cpp under systemd behind a LiteLLM proxy.

Each package here is a room, and its __init__ says what it is for and what it may import
(tests/test_rooms.py holds that). The modules at this level are the core every room stands on:
errors, files, hold, keys, layout, run and sizes. They import only each other and the standard
library at their top.
"""

__version__ = "0.1.0"
