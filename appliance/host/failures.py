"""The failures B70 owners posted for vLLM on XPU and llama.cpp with SYCL, each with its lines as
posted (its `sample`), its public source, its cause and its fix: a failed start's output is read
for them, so that the switch's error names the cause and the fix in one line, quoting the
runtime's own line.

The catalogue is ordered from the most particular to the most general: a start's output is
matched against each failure in turn, and the first failure with a matching line names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# journalctl's short and short-iso forms: "Dec 03 22:01:00 host unit[pid]: ", and
# "2026-12-03T22:01:00+0000 host unit[pid]: "
JOURNAL_PREFIX = re.compile(
    r"^(\w{3} \d{1,2} [\d:]{8}|\d{4}-\d\d-\d\dT[\d:]{8}(\.\d+)?([+-]\d{4}|Z))"
    r" \S+ [^:\s]+(\[\d+\])?: "
)
PROCESS_PREFIX = re.compile(r"^\((EngineCore|APIServer|EngineCore_DP\d+|Worker\S*) pid=\d+\) ")
MOST_QUOTED = 220


@dataclass(frozen=True)
class Known:
    name: str
    pattern: re.Pattern[str]
    cause: str
    fix: str
    source: str  # where owners posted it
    sample: tuple[str, ...]  # its lines as posted, which the B70 stand-in prints


KNOWN = (
    Known(
        "free-memory-read-as-zero",
        re.compile(r"Free memory on device \S+ \(0(\.\d+)?/[\d.]+ GiB\)"),
        "vLLM's XPU memory query read the card's free memory as almost none, as it does on "
        "hosts with two or more B70s and older compute runtimes",
        "upgrade Intel's compute runtime to 26.18 or later (vLLM's maintainers' advice); "
        "`b70ctl gpu` shows whether another process really holds the card",
        "https://github.com/vllm-project/vllm/pull/53990, https://github.com/vllm-project/vllm/"
        "issues/50135, https://github.com/vllm-project/vllm/pull/49482",
        (
            "device 0: torch.ops._C_cache_ops.getMemoryInfo -> free=0.00 GiB, total=30.30 GiB | "
            "torch.xpu.mem_get_info -> free=0.74, total=30.30",
            "ValueError: Free memory on device xpu:0 (0.22/30.3 GiB) on startup is less than "
            "desired GPU memory utilization (0.7, 21.21 GiB). Decrease GPU memory utilization or "
            "reduce GPU memory used by other processes.",
        ),
    ),
    Known(
        "max-seq-len-does-not-fit",
        re.compile(r"To serve at least one request with the model's max seq len"),
        "the KV cache left after the weights cannot hold one request of --max-model-len",
        "lower --max-model-len or raise --gpu-memory-utilization; `b70ctl plan NAME` gives "
        "the longest length and the utilization that fit",
        "https://github.com/SergiioB/intel-arc-pro-b70-inference-cookbook/issues/4",
        (
            "ValueError: To serve at least one request with the model's max seq len (100000), "
            "(4.26 GiB KV cache is needed, which is larger than the available KV cache memory "
            "(4.25 GiB).",
        ),
    ),
    Known(
        "no-kv-cache-memory",
        re.compile(r"No available memory for the cache blocks|Available KV cache memory: -\d"),
        "the weights and vLLM's start-up profile leave no memory for the KV cache",
        "a smaller quantization (FP8 or int4), more cards, or a higher "
        "--gpu-memory-utilization; `b70ctl plan NAME` shows what fits",
        "https://github.com/intel/llm-scaler/issues/672",
        (
            "INFO 09-11 21:21:56 [gpu_worker.py:560] Available KV cache memory: -0.61 GiB",
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine (this flag also controls CPU "
            "memory reservation on the CPU backend, despite its name). See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
        ),
    ),
    Known(
        "ccl-ipc-handle",
        re.compile(r"zeMemOpenIpcHandle"),
        "oneCCL could not share memory between the cards for tensor parallelism, as on xe "
        "kernels before 7.1",
        "Linux 7.1 or later and compute runtime 26.18.38308.1, which owners run tensor "
        "parallel on two B70s with; reboot after a crashed start (the xe driver keeps its state)",
        "https://github.com/vllm-project/vllm/issues/41663",
        (
            "oneCCL: ze_call.cpp:28 do_call: EXCEPTION: ze error at zeMemOpenIpcHandle,",
            "code: ZE_RESULT_ERROR_INVALID_ARGUMENT",
        ),
    ),
    Known(
        "ccl-plugin-missing",
        re.compile(r"Cannot open plugin library: libccl\.so|oneCCL could not be initialized"),
        "oneCCL's library is not on the library path of the engine",
        "set LD_LIBRARY_PATH to the folder holding libccl.so.1 (in the vLLM XPU image: "
        "/opt/venv/lib) in runtimes.NAME.env",
        "https://github.com/vllm-project/vllm/issues/54766",
        (
            "oneCCL could not be initialized! Could not load any plugin.",
            "Cannot open plugin library: libccl.so.1: cannot open shared object file",
        ),
    ),
    Known(
        "out-of-device-memory",
        re.compile(
            r"UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY|ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY|"
            r"XPU out of memory|can't allocate \d+ Bytes of memory on device"
        ),
        "the card ran out of memory (Level Zero); on a B70 a single allocation above 19.3 GB "
        "fails too (intel/compute-runtime#998)",
        "lower --gpu-memory-utilization or the context (-c), or a smaller quantization; for "
        "llama.cpp, a build with PR #28953, which caps allocations on a B70",
        "https://github.com/ggml-org/llama.cpp/issues/25286, "
        "https://github.com/ggml-org/llama.cpp/pull/28953",
        ("level_zero backend failed with error: 39 [UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY]",),
    ),
    Known(
        "out-of-resources",
        re.compile(r"UR_RESULT_ERROR_OUT_OF_RESOURCES|PI_ERROR_OUT_OF_RESOURCES"),
        "the engine's first pass took more memory than was left: the MoE module takes 400 MB "
        "more a layer on its first forward (intel/llm-scaler#348)",
        "lower --gpu-memory-utilization or --max-num-batched-tokens, or split the model over "
        "two cards",
        "https://github.com/intel/llm-scaler/issues/348",
        (
            "(EngineCore_DP0 pid=568) ERROR 04-16 12:49:28 [core.py:936] RuntimeError: "
            "level_zero backend failed with error: 40 (UR_RESULT_ERROR_OUT_OF_RESOURCES)",
        ),
    ),
    Known(
        "device-lost",
        re.compile(r"UR_RESULT_ERROR_DEVICE_LOST|ZE_RESULT_ERROR_DEVICE_LOST"),
        "the card was reset under the engine (an xe engine reset: `journalctl -k` shows it)",
        "Linux 7.1 or later and compute runtime 26.18.38308.1; reboot before starting again",
        "https://github.com/ggml-org/llama.cpp/issues/25286, "
        "https://github.com/intel/llm-scaler/issues/595",
        ("level_zero backend failed with error: 20 [UR_RESULT_ERROR_DEVICE_LOST]",),
    ),
    Known(
        "sycl-memory-query",
        re.compile(r"failed to get device memory size"),
        "llama.cpp's SYCL backend (from build 10717, PR #27968) could not ask Level Zero for "
        "the card's memory, and aborts",
        "a llama.cpp build with PR #28227, or one before build 10717",
        "https://github.com/ggml-org/llama.cpp/issues/28515, "
        "https://github.com/ggml-org/llama.cpp/issues/28519",
        ("[ggml_backend_sycl_device_get_memory] failed to get device memory size",),
    ),
    Known(
        "no-device",
        re.compile(
            r"No XPU devices are available|XPU device count is zero|found 0 SYCL devices|"
            r"No device of requested type available|zeInit: OTHER|Number of platforms\s+0"
        ),
        "the engine sees no Intel GPU: its user is not in the render group, /dev/dri is not "
        "passed to its container, or the card is bound to i915 instead of xe",
        "`b70ctl doctor` checks the render group, the xe driver and the by-path links",
        "https://github.com/vladmandic/sdnext/issues/3808 (a B580), "
        "https://github.com/intel/xpumanager/issues/151 (a B70)",
        ("RuntimeError: No XPU devices are available.",),
    ),
    Known(
        "unknown-architecture",
        re.compile(r"sycl_arch not recognized"),
        "the image's kernels do not know the B70's architecture (BMG-G31): an image older "
        "than the card",
        "use a newer image (vllm/vllm-openai-xpu 0.27 or later, or llm-scaler 0.21 or later)",
        "https://github.com/intel/llm-scaler/issues/397",
        ("sycl_arch not recognized: 21483225088",),
    ),
)


def by_name(name: str) -> Known:
    for known in KNOWN:
        if known.name == name:
            return known
    raise KeyError(f"no known failure {name!r}; known: {', '.join(k.name for k in KNOWN)}")


def bare(line: str) -> str:
    """A journal line without journald's and vLLM's prefixes."""
    line = JOURNAL_PREFIX.sub("", line.rstrip())
    return PROCESS_PREFIX.sub("", line).strip()


def diagnose(output: str | None) -> tuple[Known, str] | None:
    """The first known failure whose pattern a line of `output` matches, and that line."""
    if not output:
        return None
    lines = [bare(line) for line in output.splitlines()]
    for known in KNOWN:
        for line in lines:
            if known.pattern.search(line):
                return known, line
    return None


def one_line(known: Known, line: str, runtime: str = "NAME") -> str:
    """`cause: CAUSE ("THE LINE"); fix: FIX`, the fix naming `runtime`."""
    quoted = line if len(line) <= MOST_QUOTED else line[: MOST_QUOTED - 3] + "..."
    return f'cause: {known.cause} ("{quoted}"); fix: {known.fix.replace("NAME", runtime)}'
