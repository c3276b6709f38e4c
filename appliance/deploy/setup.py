"""`b70ctl setup`: the config written from the cards this machine has.

The cards are read as `b70ctl gpu` reads them (appliance.host.gpu). The recipes are
examples/b70.toml's, the two measured on one B70 (tests/test_setup.py holds them equal), and for
two or more cards examples/b70-4cards.toml's vLLM with tensor parallelism. A recipe goes in
where each card it runs on has the memory it needs (`memory_needed_gib`, what the plan and the
owners' logs give it); every choice is written as a comment above what it chose. The text is
checked as `install` checks a config before it is written.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import GIB
from appliance.config import parse
from appliance.errors import ApplianceError
from appliance.host import gpu
from appliance.host.doctor import COLLECTIVES_KERNEL, host_text, kernel_version
from appliance.host.gpu.fit import gib

# The images, pinned by tag (docs/images.md says how to move one). The community vLLM image is the
# one the recipe was measured in; llama.cpp's own SYCL server image is the one a B70 owner's
# home lab serves from (Aviator-Coding/home-ops, docs/ai/b70-llm-serving-tuning.md, 2026-09-07).
VLLM_IMAGE = "ghcr.io/riceharvest/b70-vllm:v0.31.0-b70.3"
LLAMACPP_IMAGE = "ghcr.io/ggml-org/llama.cpp:server-intel-b10820"
VLLM_OFFICIAL = "vllm/vllm-openai-xpu:v0.28.0"  # vLLM's own, published from v0.26.0
VLLM_MODEL = "hf:palmfuture/Qwen3.6-35B-A3B-GPTQ-Int4"
GGUF = "hf:ggml-org/Qwen3.6-35B-A3B-GGUF/Qwen3.6-35B-A3B-Q4_K_M.gguf"
MMPROJ = "hf:ggml-org/Qwen3.6-35B-A3B-GGUF/mmproj-Qwen3.6-35B-A3B-Q8_0.gguf"

VLLM_ONE: dict[str, Any] = {
    "engine": "vllm", "launcher": "docker", "image": VLLM_IMAGE, "model": VLLM_MODEL,
    "devices": ["/dev/dri"], "shm_size": "8g", "start_timeout_s": 900, "stop_timeout_s": 60,
    "memory_needed_gib": 26.3,
    "args": [
        "--quantization", "gptq", "--dtype", "float16", "--kv-cache-dtype", "fp8",
        "--max-model-len", "16384", "--gpu-memory-utilization", "0.82", "--max-num-seqs", "64",
        "--max-num-batched-tokens", "8192", "--language-model-only", "--cpu-offload-gb", "4",
        "--cpu-offload-params", "embed_tokens", "--no-enable-prefix-caching",
        "--mamba-ssm-cache-dtype", "float16", "--compilation-config",
        '{"cudagraph_capture_sizes":[1,2,4,8,16,24,32,40,48,56,64]}',
    ],
}  # fmt: skip
VLLM_ENV = {
    "B70_TARGET_LMHEAD_FP8": "1",
    "B70_LINEAR_FP8_FREE": "1",
    "B70_LINEAR_FP8_RE": r"(self_attn\.(qkv_proj|o_proj)|linear_attn\.(in_proj_qkvz|in_proj_qkv"
    r"|in_proj_z|out_proj)|shared_expert\.(gate_up_proj|down_proj))$",
}
VLLM_TP: dict[str, Any] = {
    "engine": "vllm", "launcher": "docker", "image": VLLM_IMAGE, "model": VLLM_MODEL,
    "shm_size": "16g", "start_timeout_s": 1200, "stop_timeout_s": 60, "memory_needed_gib": 24,
    "args": [
        "--quantization", "gptq", "--dtype", "float16", "--kv-cache-dtype", "fp8",
        "--max-model-len", "32768", "--gpu-memory-utilization", "0.82", "--max-num-seqs", "128",
        "--language-model-only", "--mamba-ssm-cache-dtype", "float16",
    ],
}  # fmt: skip
LLAMACPP: dict[str, Any] = {
    "engine": "llamacpp", "launcher": "docker", "image": LLAMACPP_IMAGE,
    "model": GGUF, "mmproj": MMPROJ, "devices": ["/dev/dri"],
    "start_timeout_s": 600, "memory_needed_gib": 22,
    "args": ["-ngl", "99", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "-c", "131072",
             "--parallel", "1"],
}  # fmt: skip


LLAMACPP_WHERE = (
    "In llama.cpp's own SYCL server image; for a llama-server you built, write "
    'launcher = "native" and command = ["/path/to/llama-server"] in place of image and devices.'
)
VLLM_WHERE = (
    "In the community B70 image it was measured in; vLLM's official XPU image "
    f"({VLLM_OFFICIAL}) runs it too, without that image's B70_* kernels."
)


@dataclass(frozen=True)
class Card:
    slot: str
    name: str
    total_bytes: int


def cards(snap: gpu.Snapshot) -> list[Card]:
    """The Intel cards whose memory can be read, in the reader's order (a card whose memory
    cannot be read, an integrated GPU say, is left out: `skipped`)."""
    out = [
        Card(m.device.pci_slot, m.device.name or f"Intel GPU {m.device.device_id:#06x}",
             m.total_bytes)
        for m in snap.devices if m.total_bytes is not None
    ]  # fmt: skip
    if not out:
        unread = [m.device.pci_slot for m in snap.devices]
        raise ApplianceError(
            "no Intel GPU here to serve: `b70ctl gpu` reads "
            + (f"none with its memory ({', '.join(unread)})" if unread else "none")
            + (f", and {len(snap.ignored)} of another vendor" if snap.ignored else ""),
            hint="`b70ctl doctor` checks for the cards, the xe driver and the kernel",
            code="no_cards",
        )
    return out


def _on(recipe: dict[str, Any], cards: list[int] | None) -> dict[str, Any]:
    """A recipe on these cards: the appliance passes a container its cards' nodes, not all of
    /dev/dri."""
    if cards is None:
        return dict(recipe)
    return {**{k: v for k, v in recipe.items() if k != "devices"}, "cards": cards}


def _fits(card: Card, recipe: dict[str, Any]) -> bool:
    return bool(card.total_bytes >= recipe["memory_needed_gib"] * GIB)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    return "[" + ", ".join(_value(x) for x in v) + "]"


def _table(name: str, values: dict[str, Any]) -> list[str]:
    lines = [f"[{name}]"]
    for key, value in values.items():
        if key != "args" or len(value) <= 4:
            lines.append(f"{key} = {_value(value)}")
            continue
        lines.append("args = [")  # a flag and its value on one line
        words: list[str] = []
        for arg in value:
            if words and arg.startswith("-"):
                lines.append("    " + ", ".join(words) + ",")
                words = []
            words.append(_value(arg))
        lines += ["    " + ", ".join(words) + ",", "]"]
    return lines


def _comment(text: str) -> list[str]:
    """A comment wrapped at 100 columns."""
    return ["# " + line for line in textwrap.wrap(text, 98)]


def kernel_found(root: Path) -> str:
    """The kernel's release, as doctor reads it (under a fixture root, else this machine's)."""
    return (host_text(root, "proc/sys/kernel/osrelease") or "").strip()


def engine_found() -> tuple[str, str | None]:
    """The container engine the runtimes run under: docker where it is installed, else podman
    where that is, else docker (doctor and install say to install it); and its path, where it
    is not where the config looks by default."""
    for name in ("docker", "podman"):
        path = shutil.which(name)
        if path is not None:
            return name, None if path == f"/usr/bin/{name}" else path
    return "docker", None


def write(
    snap: gpu.Snapshot,
    b70ctl: str,
    engine: tuple[str, str | None] = ("docker", None),
    kernel: str = "7.1",
) -> str:
    """The config for these cards, with a comment per choice; the runtimes' images under
    `engine` (engine_found's); tensor parallelism only on a `kernel` whose multi-card
    collectives work (doctor's kernel check)."""
    found = cards(snap)
    listed = ", ".join(f"{c.slot} ({c.name}, {gib(c.total_bytes)})" for c in found)
    lines = [
        "# Written by `b70ctl setup` from the cards found here (as `b70ctl gpu` reads them):",
        f"# {listed}.",
        "# The recipes are examples/b70.toml's; edit this file, then `b70ctl install`, which",
        "# pulls the models and images that are missing first.",
        "",
    ]
    one = [c for c in found if _fits(c, VLLM_ONE)]
    fits_tp = [c for c in found if _fits(c, VLLM_TP)]
    llama = [c for c in found if _fits(c, LLAMACPP)]
    tp = 1 << (len(fits_tp).bit_length() - 1) if len(fits_tp) >= 2 else 0
    runtimes: list[tuple[str, list[str], dict[str, Any], dict[str, str] | None]] = []
    old = (kernel_version(kernel) or (0, 0)) < COLLECTIVES_KERNEL
    held_back = []
    if tp and old:
        want = ".".join(map(str, COLLECTIVES_KERNEL))
        held_back = _comment(
            f"No tensor parallelism: this kernel ({kernel or 'its version unread'}) is older than "
            f"{want}, and owners report multi-card collectives broken before it. After booting "
            f"{want} or later, `b70ctl setup --force` offers vLLM over {tp} cards."
        )
        tp = 0
        lines += [*held_back, ""]
    if tp:
        chosen = [found.index(c) for c in fits_tp[:tp]]
        why = _comment(
            f"vLLM with tensor parallelism over {tp} cards ({', '.join(map(str, chosen))}): each "
            f"needs {VLLM_TP['memory_needed_gib']} GiB and has it. Its size is a power of two, as "
            "the model's attention heads divide. examples/b70-4cards.toml's recipe: a starting "
            "point, not a measured one."
        )
        runtimes.append(("vllm", why, _on(VLLM_TP, chosen), None))
    elif one:
        card = found.index(one[0])
        why = _comment(
            f"vLLM on card {card}: it needs {VLLM_ONE['memory_needed_gib']} GiB "
            f"(--gpu-memory-utilization 0.82 of 32 GiB) and the card has "
            f"{gib(one[0].total_bytes)}. fp16 GDN state: 1420-1510 tok/s generation at 64 users "
            "measured on one B70. " + VLLM_WHERE
        )
        table = _on(VLLM_ONE, [card] if len(found) > 1 else None)
        runtimes.append(("vllm", why, table, VLLM_ENV))
    if llama:
        places = [found.index(c) for c in llama]
        if len(places) >= 2:
            why = _comment(
                f"llama.cpp (SYCL), a replica on each of cards {', '.join(map(str, places))} "
                "(per_card), the proxy spreading requests over them, under a name of its own "
                f"(they take turns with vLLM on those cards); each needs "
                f"{LLAMACPP['memory_needed_gib']} GiB. `b70ctl switch llamacpp` starts them all. "
                + LLAMACPP_WHERE
            )
            table = {**_on(LLAMACPP, places), "per_card": True,
                     "served_model_name": "qwen3.6-35b-a3b-gguf", "port": 8002}  # fmt: skip
        else:
            why = _comment(
                f"llama.cpp (SYCL) on card {places[0]}: Qwen3.6-35B-A3B Q4_K_M, 131072 context, "
                "one slot, with the vision projector; it needs "
                f"{LLAMACPP['memory_needed_gib']} GiB. 69.7-75.7 tok/s single stream measured on "
                "one B70. " + LLAMACPP_WHERE
            )
            table = _on(LLAMACPP, places if len(found) > 1 else None)
        runtimes.append(("llamacpp", why, table, None))
    if not runtimes:
        least = min(LLAMACPP["memory_needed_gib"], VLLM_ONE["memory_needed_gib"])
        raise ApplianceError(
            f"no recipe fits these cards: the smallest needs {least} GiB on a card, and the "
            f"largest here has {gib(max(c.total_bytes for c in found))}",
            hint="write the config by hand (examples/b70.toml is the pattern) with a smaller "
            "model; `b70ctl plan` says what a vLLM recipe needs", code="no_recipe_fits",
        )  # fmt: skip
    default = runtimes[0][0]
    lines += [
        f"# {default} serves after install; `b70ctl switch NAME` changes it.",
        f'default_runtime = "{default}"',
        f"b70ctl = {_value(b70ctl)}",
        *(
            [f"# {engine[0]} is where this machine has it", f"{engine[0]} = {_value(engine[1])}"]
            if engine[1]
            else []
        ),
        "",
        "# Other machines reach :8000 over TLS (a self-signed certificate made at install;",
        "# `b70ctl status` shows its fingerprint). Loopback stays plain HTTP.",
        "[proxy]",
        'host = "0.0.0.0"',
        "port = 8000",
        "tls = true",
        'model = "qwen3.6-35b-a3b"',
        'aliases = ["default"]',
        "hold_s = 300",
        "",
        "[backend]",
        'host = "127.0.0.1"',
        "port = 8001",
        "",
        "[gpu]",
        _gpu_line(snap, found),
        "release_timeout_s = 120",
    ]
    if engine[0] != "docker":
        lines += [
            "",
            f"# The images run under {engine[0]}: it is installed here and docker is not.",
        ]
    for name, why, table, env in runtimes:
        if table.get("launcher") == "docker":
            table = {**table, "launcher": engine[0]}
        lines += ["", *why, *_table(f"runtimes.{name}", table)]
        if env:
            lines += ["", *_table(f"runtimes.{name}.env", env)]
    text = "\n".join(lines) + "\n"
    parse(text, Path("setup"))  # what install would refuse is never written
    return text


def _gpu_line(snap: gpu.Snapshot, found: list[Card]) -> str:
    if len(found) > 1:
        return f"cards = {_value([c.slot for c in found])}"
    if len(snap.devices) == 1:
        return 'device = "auto"'
    return f"device = {_value(found[0].slot)}"  # the one of several whose memory is known


def skipped(snap: gpu.Snapshot) -> Sequence[str]:
    """What the config leaves out, for the command to say."""
    out = [f"{d.pci_slot}: not an Intel GPU" for d in snap.ignored]
    out += [f"{m.device.pci_slot}: its memory cannot be read ({m.error or m.source})"
            for m in snap.devices if m.total_bytes is None]  # fmt: skip
    for c in cards(snap):
        if not _fits(c, LLAMACPP) and not _fits(c, VLLM_ONE):
            out.append(f"{c.slot} ({c.name}, {gib(c.total_bytes)}): no recipe fits")
    return out
