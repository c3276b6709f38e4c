"""The switch's own files on a file system that refuses writes: nothing raises half-way."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from appliance import edges, errors, files, monitor, state
from appliance.layout import LAST_SWITCH
from appliance.plans import Memory
from appliance.proxy import hold


def full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_record_that_cannot_be_written_is_said_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert state.record_switch(tmp_path, {"target": "vllm"}) is None
    monkeypatch.setattr(state, "write_atomic", full)
    problem = state.record_switch(tmp_path, {"target": "llamacpp"})
    assert problem is not None and str(tmp_path) in problem and "No space left" in problem
    assert json.loads((tmp_path / LAST_SWITCH).read_text())["target"] == "vllm"


def test_a_note_that_cannot_be_written_does_not_stop_the_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with state.switch_lock(tmp_path, "vllm") as lock:
        monkeypatch.setattr(state.os, "pwrite", full)
        lock.note(phase="start")
        assert lock.unwritten == "No space left on device"
        assert lock.info["phase"] == "start"


def test_a_hold_mark_that_cannot_be_written_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hold, "_write", full)
    with pytest.raises(hold.Unwritable), hold.marked(tmp_path, "vllm"):
        pass
    with pytest.raises(errors.ApplianceError) as e, edges.holding(tmp_path, "vllm"):
        pass
    assert e.value.code == "state_unwritable"
    assert "nothing was changed" in e.value.message and str(tmp_path) in e.value.hint


def test_write_atomic_names_the_file_it_could_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError) as e:
        files.write_atomic(tmp_path / "a.json", "{}")
    assert e.value.filename == str(tmp_path / "a.json")
    assert list(tmp_path.iterdir()) == [], "the temporary file is gone"
    error = errors.from_exception(e.value)
    assert error.message.startswith(str(tmp_path / "a.json"))
    assert error.hint == f"the file system is full: free space there (df -h {tmp_path / 'a.json'})"


def test_the_monitor_logs_a_state_it_cannot_save_once_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines: list[str] = []
    m = Memory(restarts_by_monitor=2)
    monkeypatch.setattr(monitor, "write_atomic", full)
    for _ in range(3):
        doc = monitor.save(tmp_path, m, None, lines.append)
    assert doc["restarts_by_monitor"] == 2
    assert len(lines) == 1 and "cannot save the monitor's state" in lines[0]
    monkeypatch.undo()
    monitor.save(tmp_path, m, None, lines.append)
    assert lines[1] == "the monitor's state is saved again"
    assert monitor.restore(tmp_path).restarts_by_monitor == 2
