"""Live progress on a terminal: one line redrawn in place, each finished phase left above it."""

from __future__ import annotations

import io
import time

from appliance.cli.live import Live

LOADING = "Loading safetensors checkpoint shards:  50% Completed | 1/2"


def test_the_line_moves_with_elapsed_time_vram_and_the_runtimes_own_loading_line() -> None:
    out = io.StringIO()
    asked: list[str] = []

    def tail(unit: str) -> str:
        asked.append(unit)
        return LOADING

    live = Live(out, tail, vram=lambda: "0000:03:00.0 4.1/32.0 GiB", width=lambda: 200,
                redraw_s=0.01, look_s=0)  # fmt: skip
    live("starting", "b70-vllm.service")
    live("loading", "b70-vllm.service")
    time.sleep(0.15)
    live("verifying", "a completion through port 8000")
    live.close()
    text = out.getvalue()
    frames = [f for f in text.split("\r\x1b[K") if f]
    loading = [f for f in frames if f.lstrip("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏ ").startswith("loading:")]
    assert len(loading) >= 3  # redrawn while it lasts
    assert any(LOADING in f and "VRAM 0000:03:00.0 4.1/32.0 GiB" in f for f in loading)
    assert asked and set(asked) == {"b70-vllm.service"}  # the journal of the unit that loads
    finished = [f for f in frames if f.endswith(" s)\n")]
    assert [f.split(":")[0].strip() for f in finished] == ["starting", "loading", "verifying"]
    assert text.endswith(" s)\n")  # close() leaves the last phase, and no half-drawn line


def test_a_long_line_is_cut_to_the_terminal() -> None:
    out = io.StringIO()
    live = Live(out, lambda unit: "x" * 500, vram=lambda: None, width=lambda: 60,
                redraw_s=0.01, look_s=0)  # fmt: skip
    live("loading", "b70-llamacpp.service")
    time.sleep(0.05)
    live.close()
    frames = [f for f in out.getvalue().split("\r\x1b[K") if f and not f.endswith("\n")]
    assert frames and all(len(f) <= 59 for f in frames)
    assert any(f.endswith("…") for f in frames)
