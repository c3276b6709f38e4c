"""The failures B70 owners posted, named: each one's own lines are found in a start's output
(behind journald's and vLLM's prefixes), and a failed switch's error gives the cause and the
fix in one line, quoting the runtime's line."""

from __future__ import annotations

import pytest

from appliance.errors import ApplianceError
from appliance.host import failures
from tests.test_executor import execute


@pytest.mark.parametrize("known", failures.KNOWN, ids=[k.name for k in failures.KNOWN])
def test_each_failure_is_named_by_its_own_lines(known: failures.Known) -> None:
    journal = "\n".join(
        f"Dec 03 21:58:0{i} b70 python3[4242]: (EngineCore pid=316) {line}"
        for i, line in enumerate(["INFO Loading weights", *known.sample, "ERROR engine died"])
    )
    found = failures.diagnose(journal)
    assert found is not None and found[0] is known, found
    assert found[1] in known.sample[0] + "\n".join(known.sample)
    assert known.source.startswith("https://")


def test_journalctls_short_iso_lines_are_read_too() -> None:
    line = (
        "2026-12-03T22:44:54+0000 vm b70-vllm[3818]: level_zero backend failed with error: 39 "
        "[UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY]"
    )
    found = failures.diagnose(line)
    assert found is not None and found[1].startswith("level_zero backend failed")


def test_output_without_a_known_failure_names_none() -> None:
    assert failures.diagnose("INFO starting\nERROR something else went wrong\n") is None
    assert failures.diagnose(None) is None


def test_a_real_holder_on_the_card_is_not_read_as_a_false_zero() -> None:
    """Free memory of 0.22 GiB is vLLM's false reading; 7.34 GiB free is a card really in use."""
    used = "ValueError: Free memory on device xpu:0 (7.34/30.3 GiB) on startup is less than " \
        "desired GPU memory utilization (0.9, 27.27 GiB)."  # fmt: skip
    assert failures.diagnose(used) is None


def test_a_failed_switch_names_the_cause_and_the_fix_in_one_line() -> None:
    known = failures.by_name("no-kv-cache-memory")
    journal = "\n".join(
        f"Dec 03 22:01:00 b70 python3[77]: (EngineCore pid=183) {s}" for s in known.sample
    )
    _, error = execute("llamacpp", "vllm", fail={"start vllm"}, journal=journal)
    assert isinstance(error, ApplianceError)
    lines = error.message.splitlines()
    assert lines[0] == "switch to vllm failed: start vllm failed"
    assert lines[1] == (
        "  cause: the weights and vLLM's start-up profile leave no memory for the KV cache "
        '("INFO 09-11 21:21:56 [gpu_worker.py:560] Available KV cache memory: -0.61 GiB"); '
        "fix: a smaller quantization (FP8 or int4), more cards, or a higher "
        "--gpu-memory-utilization; `b70ctl plan vllm` shows what fits"
    )
    assert "rolled back: llamacpp is serving again" in error.message


def test_an_unknown_failure_name_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="no known failure 'nope'; known: free-memory-read-as-zero"):
        failures.by_name("nope")
