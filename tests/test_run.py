"""The one way the controller runs another program (appliance.run)."""

from __future__ import annotations

import pytest

from appliance import run
from appliance.errors import ApplianceError


def test_a_finished_program_is_returned_whatever_its_status() -> None:
    out = run.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=10, hint="h")
    assert (out.returncode, out.stdout, out.stderr) == (3, "out\n", "err\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["/no/such/program"], "/no/such/program is not installed"),
        (["/dev/null"], "cannot run /dev/null: Permission denied"),
        (["sleep", "5"], "sleep 5: no answer within 0.2 s"),
    ],
)
def test_a_program_that_cannot_run_or_end_is_the_appliances_error(
    argv: list[str], message: str
) -> None:
    with pytest.raises(ApplianceError) as e:
        run.run(argv, timeout_s=0.2, hint="install it", code="verify_failed")
    assert (e.value.message, e.value.hint, e.value.code) == (message, "install it", "verify_failed")
    assert run.ask(argv, timeout_s=0.2) is None


def test_stdin_is_closed() -> None:
    out = run.ask(["cat"], timeout_s=5)
    assert out is not None and out.returncode == 0 and out.stdout == ""
