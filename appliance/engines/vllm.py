"""vLLM: what it compiles at a start (torch.compile's graphs, Inductor's and Triton's kernels,
and on Intel's GPUs the SYCL and compute runtimes' device code), where it keeps each, and the
lines by which a start says whether it compiled or loaded what an earlier one compiled.

vLLM keys its torch.compile cache itself: a folder per hash of its own version, the model's and
the engine's config, the vLLM variables that matter, the traced source and the compiler's build
(vllm/compilation/backends.py; AOT artifacts: vllm/compilation/decorators.py). Triton keys a
kernel by its source and target, the SYCL and compute runtimes by the device code, its build
options and the device. None of them keys by the flags of a patched image (the B70 images'
B70_* variables), so the appliance keys the folder by the whole recipe as well
(appliance.engines.lasting).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from appliance.engines import oneapi
from appliance.engines.facts import CacheVariable, EngineFacts, StartCache

ENVS = "vllm-project/vllm, vllm/envs.py"

CACHES = (
    # torch.compile's graphs and AOT artifacts, with Inductor's cache beside them
    # (VLLM_CACHE_ROOT/torch_compile_cache/...); default $XDG_CACHE_HOME/vllm or ~/.cache/vllm.
    CacheVariable("VLLM_CACHE_ROOT", "vllm", source=ENVS),
    # Triton's kernels outside torch.compile (vLLM's own Triton ops); default ~/.triton/cache
    # (triton-lang/triton, python/triton/knobs.py). vLLM 0.34 leaves a value given here alone.
    CacheVariable(
        "TRITON_CACHE_DIR", "triton", source="triton-lang/triton, python/triton/knobs.py"
    ),
    # Inductor's kernels compiled outside vLLM's own cache folder; default /tmp/torchinductor_USER
    # (pytorch/pytorch, torch/_inductor/runtime/cache_dir_utils.py).
    CacheVariable(
        "TORCHINDUCTOR_CACHE_DIR",
        "inductor",
        source="pytorch/pytorch, torch/_inductor/runtime/cache_dir_utils.py",
    ),
    # From vLLM 0.26.0 (vllm-project/vllm#47388): the memory profile of an earlier start, kept
    # under VLLM_CACHE_ROOT/startup_plan and applied only while the card has at least the free
    # memory it had then. Releases before 0.26 do not know the variable and start as before.
    CacheVariable("VLLM_ENABLE_STARTUP_PLAN", value="1", source=ENVS),
    *oneapi.NEO,
    *oneapi.SYCL,
)

# Where the folder cannot be written, vLLM must not try to save its compile cache either.
COLD_ENV = {"VLLM_DISABLE_COMPILE_CACHE": "1"}

# vLLM's own words (vllm/compilation/backends.py, decorators.py; vllm/v1/engine/core.py), in
# the releases from 0.24 on; older releases said "dynamic shape" and "seconds".
LOADED = re.compile(
    r"Directly load (the compiled graph\(s\) for .* from the cache|AOT compilation from path)"
)
COMPILED = re.compile(
    r"Compiling a graph for (compile range|dynamic shape) .*takes? [\d.]+ s"
    r"|saved AOT compiled function to"
)
LOAD_FAILED = re.compile(
    r"Compiling model again due to a load failure from (?P<path>\S+?),? reason: (?P<why>.*)"
)
SOURCE_CHANGED = re.compile(r"Source code has changed since the last compilation")
DISABLED = re.compile(r"vLLM's torch\.compile cache is disabled")
INIT = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took (?P<init>[\d.]+) s(?:econds)?"
    r"(?: \(compilation: (?P<compile>[\d.]+) s)?"
)


def read_start(text: str) -> StartCache | None:
    """What one start's lines (its journal, oldest first) say of vLLM's compile cache; None
    before vLLM said anything of it."""
    lines = text.splitlines()
    said = [line for line in lines if _about_cache(line)]
    init = next((m for line in reversed(lines) if (m := INIT.search(line))), None)
    init_s = float(init["init"]) if init else None
    compile_s = float(init["compile"]) if init and init["compile"] else None
    failed = next((m for line in said if (m := LOAD_FAILED.search(line))), None)
    kept = tuple(line.strip() for line in said)
    if failed:
        cause = (
            f"vLLM could not load its compile cache ({failed['why'].strip()}) and compiled again"
        )
        return StartCache("cold", cause, init_s, compile_s, kept)
    if any(SOURCE_CHANGED.search(line) for line in said):
        cause = "vLLM found its source changed since the cache was written and compiled again"
        return StartCache("cold", cause, init_s, compile_s, kept)
    if any(DISABLED.search(line) for line in said):
        return StartCache("cold", "vLLM's compile cache is turned off", init_s, compile_s, kept)
    compiled = any(COMPILED.search(line) for line in said)
    loaded = any(LOADED.search(line) for line in said)
    if compiled:
        cause = "part of the model was not in the cache" if loaded else "nothing to load yet"
        return StartCache("cold", cause, init_s, compile_s, kept)
    if loaded:
        return StartCache("warm", "", init_s, compile_s, kept)
    if init is not None:  # up, and silent about its cache (vLLM's CPU build, or --enforce-eager)
        return StartCache("", "", init_s, compile_s, kept)
    return None


def _about_cache(line: str) -> bool:
    return any(p.search(line) for p in (LOADED, COMPILED, LOAD_FAILED, SOURCE_CHANGED, DISABLED))


def compiles(args: Sequence[str]) -> bool:
    """Whether a start with these flags compiles anything: not with --enforce-eager."""
    return "--enforce-eager" not in args


FACTS = EngineFacts(
    name="vLLM",
    compiles=compiles,
    caches=CACHES,
    cold_env=COLD_ENV,
    # what a compiling start leaves: vLLM's graphs, Inductor's and Triton's kernels (the CPU
    # build's C++ kernels are Inductor's), the compute runtime's
    warm_globs=("vllm/torch_compile_cache/*", "inductor/*", "triton/*", "neo/*", "sycl/*"),
    read_start=read_start,
)
