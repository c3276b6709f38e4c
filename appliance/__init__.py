"""The b70 appliance: vLLM and llama.cpp under systemd behind a LiteLLM proxy."""

__version__ = "0.1.0"
