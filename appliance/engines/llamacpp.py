"""llama.cpp's server (llama-server), built with SYCL: what it compiles at a start is the SYCL
runtime's and the compute runtime's, and it prints nothing about either."""

from __future__ import annotations

from appliance.engines import oneapi
from appliance.engines.facts import EngineFacts

FACTS = EngineFacts(
    name="llama.cpp",
    caches=(*oneapi.NEO, *oneapi.SYCL),
    # What the SYCL runtime or the compute runtime wrote there: only a start that compiled
    # device code leaves it.
    warm_globs=("neo/*", "sycl/*"),
)
