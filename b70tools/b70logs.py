"""The start-up logs B70 owners published, as `b70ctl plan` is held against them: each with its
public source, `vllm serve`'s flags, what vLLM logged, and the model whose geometry
tests/fixtures/b70/ holds (rebuilt from public excerpts)."""

from __future__ import annotations

GIB = 1024**3
MTP5 = '{"method":"mtp","num_speculative_tokens":5}'
MTP4 = '{"method":"mtp","num_speculative_tokens":4}'
HOTSCHMOE = "https://github.com/hotschmoe/b70_ai_things (agentic-eval/results/logs)"

# name, config, flags, logged: available GiB, tokens, concurrency, block, padding %, source
LOGS = [
    ("L1", "Qwen-Qwen3.6-27B", ["--max-model-len", "8192", "--tensor-parallel-size", "2",
     "--no-enable-prefix-caching", "--max-num-seqs", "64", "--quantization", "inc",
     "--dtype", "bfloat16", "--limit-mm-per-prompt", '{"image": 0, "video": 0}'],
     17.98, 444_888, 54.31, 832, "6.26", HOTSCHMOE),
    ("L8", "Qwen-Qwen3.6-27B", ["--dtype", "bfloat16", "--max-model-len", "8192",
     "--gpu-memory-utilization", "0.85", "--no-enable-prefix-caching", "--max-num-seqs", "4",
     "--quantization", "modelopt_mixed", "--speculative-config", MTP5],
     1.65, 8_777, 1.07, 832, "2.97", HOTSCHMOE),
    ("L9", "Qwen-Qwen3.6-27B", ["--dtype", "bfloat16", "--max-model-len", "131072", "-tp", "2",
     "--gpu-memory-utilization", "0.85", "--no-enable-prefix-caching", "--max-num-seqs", "8",
     "--quantization", "modelopt_mixed", "--speculative-config", MTP5],
     14.1, 388_747, 2.97, 832, "2.97", HOTSCHMOE),
    ("L10", "Qwen-Qwen3.6-35B-A3B", ["--dtype", "float16", "--max-model-len", "16384",
     "--gpu-memory-utilization", "0.9", "--max-num-seqs", "128", "--no-enable-prefix-caching",
     "--quantization", "inc"], 5.28, 219_028, 13.37, 1088, "3.82",
     "https://github.com/MidasMining/llm-bench (results/b70/moe_xpugraph_default_kv.txt)"),
    ("L11", "Qwen-Qwen3.6-27B", ["--tensor-parallel-size", "2", "--dtype", "float16",
     "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--max-model-len", "262144",
     "--block-size", "128", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.92",
     "--enforce-eager", "--no-enable-prefix-caching"], 13.89, 888_488, None, None, None,
     "https://github.com/steveseguin/b70-optimization-lab (STATUS.md)"),
    ("L16", "Qwen-Qwen3.8-27B", ["--quantization", "gptq", "--dtype", "float16",
     "--max-model-len", "100000", "--gpu-memory-utilization", "0.75", "--kv-cache-dtype", "fp8",
     "--max-num-seqs", "1", "--max-num-batched-tokens", "8192", "--no-enable-prefix-caching",
     "--kv-cache-memory-bytes", str(int(4.25 * GIB)), "--language-model-only",
     "--speculative-config", MTP4], 4.25, 102_631, 1.03, 1664, "3.61",
     "https://github.com/SergiioB/intel-arc-pro-b70-inference-cookbook/issues/4"),
]  # fmt: skip


# Logged weights on each card ("Model loading took"), where the log states them.
WEIGHTS = {"L1": 8.42, "L8": 24.9, "L9": 12.6, "L10": 19.66, "L11": 14.13}

# The vLLM release each log ran, as the plan takes it: L1 "version 0.23.0", L8 and L9 0.24.0
# (their logs); L10 a build of vLLM's main from June 2026 ("0.1.dev1+gd272418f4"), before
# getMemoryInfo came in 0.26, taken as 0.23; L11 Intel's llm-scaler 0.21.0-b1 (torch 2.11);
# L16 "0.27.2rc1.dev77" (its cache was pinned, so only the paging is held against it).
RELEASES = {"L1": "0.23", "L8": "0.24", "L9": "0.24", "L10": "0.23", "L11": "0.21", "L16": "0.27"}

# The seed recipe (examples/b70.toml) on one B70 in the B70 image (vLLM 0.31): with the fp32 GDN
# state its cache filled at 61 requests of 1,024 tokens (the seed's own measurement).
SEED = (
    "Qwen-Qwen3.6-35B-A3B",
    [
        "--quantization",
        "gptq",
        "--dtype",
        "float16",
        "--kv-cache-dtype",
        "fp8",
        "--max-model-len",
        "16384",
        "--gpu-memory-utilization",
        "0.82",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "8192",
        "--language-model-only",
        "--cpu-offload-gb",
        "4",
        "--cpu-offload-params",
        "embed_tokens",
        "--no-enable-prefix-caching",
    ],
    1024,
    61,
    "0.31",
)
