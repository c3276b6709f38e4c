"""The caches of Intel's GPU stack under both engines: the compute runtime's (NEO, behind Level
Zero and OpenCL) and the SYCL runtime's (DPC++). Both keep device code they JIT-compiled.

The compute runtime keeps its kernels by default (Level Zero from its 24.13 release), in
$XDG_CACHE_HOME/neo_compiler_cache or $HOME/.cache/neo_compiler_cache: inside a container, that
is lost at every stop. It keys each kernel by its input, its build options, the compiler's build
and the device. A NEO_CACHE_DIR that does not exist turns the cache off without a word, so a
start's check makes the folder first. Its releases 25.31 to 26.31 also turn it off when any IGC_
variable is set (compute-runtime commit 6975f7bb; the later fix hashes those keys instead).

The SYCL runtime keeps nothing unless SYCL_CACHE_PERSISTENT=1, and the appliance does not turn
it on: on Xe2 cards such as the B70 it segfaults during the first JIT compile (intel/llvm#22853,
ggml-org/llama.cpp#22095), and llama.cpp's SYCL guide advises against it (ggml-org/llama.cpp
#26442). The compute runtime's cache keeps the same device code one level down. SYCL_CACHE_DIR
still points into the lasting folder, so an owner who sets SYCL_CACHE_PERSISTENT=1 in a
runtime's env keeps that cache too.
"""

from __future__ import annotations

from appliance.engines.facts import CacheVariable

SYCL_DOC = "intel/llvm, sycl/doc/EnvironmentVariables.md"
NEO_DOC = "intel/compute-runtime, programmers-guide/COMPILER_CACHE.md"

NEO = (
    CacheVariable("NEO_CACHE_PERSISTENT", value="1", source=NEO_DOC),
    CacheVariable("NEO_CACHE_DIR", "neo", source=NEO_DOC),
)
SYCL = (CacheVariable("SYCL_CACHE_DIR", "sycl", source=SYCL_DOC),)
