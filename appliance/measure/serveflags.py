"""vLLM's `vllm serve` flags, read as vLLM reads them, for the plan.

Only what changes the memory plan is kept; every other flag is named in `ignored`, so that
`b70ctl plan` can take a runtime's whole argument list (or a line from a shell history) as it is.
Spellings follow vLLM's own argument parser (vllm/engine/arg_utils.py): `--flag value` and
`--flag=value`, `-tp` and `-q` for tensor parallelism and quantization, `--no-` to turn a
boolean off, sizes such as `16k` or `1Gi` where vLLM takes human-readable numbers
(`--max-model-len`, `--kv-cache-memory-bytes`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from appliance.errors import ApplianceError


@dataclass(frozen=True)
class Serve:
    """The flags of one `vllm serve`, with vLLM's defaults where a flag is not given."""

    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's own (max_position_embeddings)
    gpu_memory_utilization: float = 0.92  # vLLM's default in the B70 releases (0.2x)
    max_num_seqs: int | None = None  # None: vLLM's default for the card
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    num_speculative_tokens: int = 0
    speculative_method: str | None = None
    enable_prefix_caching: bool | None = None  # None: vLLM's default (on)
    mamba_cache_mode: str | None = None
    enforce_eager: bool = False
    cpu_offload_gb: float = 0.0
    cpu_offload_params: tuple[str, ...] = ()
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None
    language_model_only: bool = False
    ignored: tuple[str, ...] = field(default=())


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?\s*$")
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def human_int(flag: str, text: str) -> int:
    """vLLM's human-readable integers: `16384`, `16k` (x1000), `16K` or `16Ki` (x1024)."""
    m = _SIZE.match(text)
    if not m:
        raise _bad(flag, text, "a whole number such as 16384, 16k or 4Gi")
    number, unit = float(m.group(1)), m.group(2)
    if unit is None:
        if not number.is_integer():
            raise _bad(flag, text, "a whole number")
        return int(number)
    letter = unit[0]
    binary = unit.endswith("i") or letter.isupper()
    base = 1024 if binary else 1000
    return int(number * base ** _POWERS[letter.lower()])


def _bad(flag: str, text: str, wanted: str) -> ApplianceError:
    return ApplianceError(
        f"{flag} {text!r} is not {wanted}",
        hint="spell the flag as `vllm serve` takes it",
        code="plan_input_invalid",
    )


def _int(flag: str, text: str, least: int) -> int:
    value = human_int(flag, text)
    if value < least:
        raise _bad(flag, text, f"a number of {least} or more")
    return value


def _float(flag: str, text: str, low: float, high: float, *, low_open: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _bad(flag, text, "a number") from None
    if not (low < value if low_open else low <= value) or value > high:
        side = "(" if low_open else "["
        raise _bad(flag, text, f"a number in {side}{low:g}, {high:g}]")
    return value


def speculative(text: str) -> tuple[str | None, int]:
    """`--speculative-config '{"method": "mtp", "num_speculative_tokens": 5}'`."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise _bad("--speculative-config", text, "a JSON object") from None
    if not isinstance(doc, dict):
        raise _bad("--speculative-config", text, "a JSON object")
    n = doc.get("num_speculative_tokens", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise _bad(
            "--speculative-config", text, "a JSON object whose num_speculative_tokens is 0 or more"
        )
    method = doc.get("method")
    return (method if isinstance(method, str) else None), n


# Flags that take a value, by vLLM's name, and the field each one sets.
_VALUES = {
    "--tensor-parallel-size": "tensor_parallel_size", "-tp": "tensor_parallel_size",
    "--max-model-len": "max_model_len", "--gpu-memory-utilization": "gpu_memory_utilization",
    "--max-num-seqs": "max_num_seqs", "--max-num-batched-tokens": "max_num_batched_tokens",
    "--dtype": "dtype", "--quantization": "quantization", "-q": "quantization",
    "--kv-cache-dtype": "kv_cache_dtype", "--mamba-cache-dtype": "mamba_cache_dtype",
    "--mamba-ssm-cache-dtype": "mamba_ssm_cache_dtype", "--mamba-cache-mode": "mamba_cache_mode",
    "--speculative-config": "speculative", "--cpu-offload-gb": "cpu_offload_gb",
    "--cpu-offload-params": "cpu_offload_params",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
    "--block-size": "block_size", "--limit-mm-per-prompt": "limit_mm_per_prompt",
}  # fmt: skip
_SWITCHES = {
    "--enable-prefix-caching": ("enable_prefix_caching", True),
    "--no-enable-prefix-caching": ("enable_prefix_caching", False),
    "--enforce-eager": ("enforce_eager", True), "--no-enforce-eager": ("enforce_eager", False),
    "--language-model-only": ("language_model_only", True),
    "--no-language-model-only": ("language_model_only", False),
}  # fmt: skip
KV_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _canon(flag: str) -> str:
    """vLLM takes `--max_model_len` as well as `--max-model-len`."""
    return flag if not flag.startswith("--") else "--" + flag[2:].replace("_", "-")


def parse(argv: Sequence[str]) -> Serve:
    """Read `vllm serve`'s flags; a model named first (`vllm serve MODEL ...`) is skipped."""
    values: dict[str, object] = {}
    ignored: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-"):
            ignored.append(arg)
            continue
        flag, eq, inline = arg.partition("=")
        flag = _canon(flag)
        if flag in _SWITCHES and not eq:
            key, on = _SWITCHES[flag]
            values[key] = on
            continue
        if flag not in _VALUES:
            ignored.append(flag)
            if not eq and i < len(args) and not args[i].startswith("-"):
                i += 1  # its value
            continue
        if eq:
            text = inline
        elif i < len(args):
            text = args[i]
            i += 1
        else:
            raise _bad(flag, "", "given: the flag needs a value")
        _set(values, flag, _VALUES[flag], text)
    return Serve(**values, ignored=tuple(ignored))  # type: ignore[arg-type]


def _no_media(flag: str, text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        raise _bad(flag, text, 'a JSON object such as {"image": 0}') from None
    if not isinstance(doc, dict):
        raise _bad(flag, text, 'a JSON object such as {"image": 0}')
    limits = [v.get("count") if isinstance(v, dict) else v for v in doc.values()]
    return bool(limits) and all(v == 0 and not isinstance(v, bool) for v in limits)


def _set(values: dict[str, object], flag: str, key: str, text: str) -> None:
    if (
        key in ("tensor_parallel_size", "max_num_seqs", "block_size")
        or key in ("max_model_len", "max_num_batched_tokens")
        or key == "kv_cache_memory_bytes"
    ):
        values[key] = _int(flag, text, 1)
    elif key == "gpu_memory_utilization":
        values[key] = _float(flag, text, 0.0, 1.0, low_open=True)
    elif key == "cpu_offload_gb":
        values[key] = _float(flag, text, 0.0, float("inf"))
    elif key == "speculative":
        values["speculative_method"], values["num_speculative_tokens"] = speculative(text)
    elif key == "cpu_offload_params":
        values[key] = tuple(p for p in re.split(r"[,\s]+", text) if p)
    elif key == "limit_mm_per_prompt":
        # vLLM skips the encoder when every modality's limit is 0 (`{"image": 0, "video": 0}`)
        if _no_media(flag, text):
            values["language_model_only"] = True
    elif key == "quantization":
        values[key] = None if text in ("", "none", "None") else text
    else:
        choices = {
            "dtype": MODEL_DTYPES, "kv_cache_dtype": KV_DTYPES, "mamba_cache_dtype": MAMBA_DTYPES,
            "mamba_ssm_cache_dtype": MAMBA_DTYPES, "mamba_cache_mode": ("none", "align", "all"),
        }[key]  # fmt: skip
        if text not in choices:
            raise _bad(flag, text, "one of " + ", ".join(choices))
        values[key] = text
