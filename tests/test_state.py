"""The switch's own files on a file system that refuses writes: nothing raises half-way."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from appliance import errors, files, hold
from appliance.layout import KILLED_FILE, LAST_SWITCH, NOTE_FILE, Scope
from appliance.switch import edges, plans, records
from appliance.switch import lock as lock_mod
from appliance.switch.lock import killed_switch, switch_lock, waiting_trace, writer_lock
from appliance.switch.plans import Memory
from appliance.switch.records import record_switch
from appliance.watch import monitor
from tests.conftest import tree_snapshot


def full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_record_that_cannot_be_written_is_said_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert record_switch(tmp_path, {"target": "vllm"}) is None
    monkeypatch.setattr(records, "write_atomic", full)
    problem = record_switch(tmp_path, {"target": "llamacpp"})
    assert problem is not None and str(tmp_path) in problem and "No space left" in problem
    assert json.loads((tmp_path / LAST_SWITCH).read_text())["target"] == "vllm"


def test_a_note_that_cannot_be_written_does_not_stop_the_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with switch_lock(tmp_path, "vllm") as lock:
        monkeypatch.setattr(lock_mod, "write_atomic", full)
        lock.note(phase="start")
        assert lock.unwritten == "No space left on device"
        assert lock.info["phase"] == "start"


def test_a_hold_mark_that_cannot_be_written_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hold, "write_shared", full)
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


def test_the_monitor_logs_a_record_it_cannot_save_once_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines: list[str] = []
    m = Memory(restarts_by_monitor=2)
    monkeypatch.setattr(monitor, "write_atomic", full)
    for _ in range(3):
        doc = monitor.save(tmp_path, m, None, lines.append)
    assert doc["restarts_by_monitor"] == 2
    assert len(lines) == 1 and "cannot save the monitor's record" in lines[0]
    monkeypatch.undo()
    monitor.save(tmp_path, m, None, lines.append)
    assert lines[1] == "the monitor's record is saved again"
    assert monitor.restore(tmp_path).restarts_by_monitor == 2


def test_a_killed_switchs_note_waits_until_a_recovery_clears_it(tmp_path: Path) -> None:
    """A note left behind moves aside when the next writer takes the lock, and stays there until
    that writer says it recovered: a recovery that fails loses no trace."""
    note = {"pid": 999999999, "pid_start": "1", "target": "vllm", "phase": "start"}
    (tmp_path / NOTE_FILE).write_text(json.dumps(note))
    assert waiting_trace(tmp_path) == note, "status sees it, from the note alone"
    with pytest.raises(RuntimeError), switch_lock(tmp_path, "llamacpp") as lock:
        assert lock.stale == note
        raise RuntimeError("the recovery failed")
    assert json.loads((tmp_path / KILLED_FILE).read_text()) == note
    assert waiting_trace(tmp_path) == note
    with killed_switch(tmp_path) as trace:
        assert trace is not None and trace.info == note
        trace.clear_stale()
    assert not (tmp_path / KILLED_FILE).exists() and not (tmp_path / NOTE_FILE).exists()
    assert waiting_trace(tmp_path) is None


def test_status_reads_a_running_switch_as_running_and_writes_nothing(tmp_path: Path) -> None:
    with switch_lock(tmp_path, "vllm"):
        before = tree_snapshot(tmp_path)
        assert waiting_trace(tmp_path) is None  # this process is alive: not killed
        assert tree_snapshot(tmp_path) == before


def test_install_holds_the_lock_and_a_switch_is_told_who(tmp_path: Path) -> None:
    with (
        writer_lock(tmp_path, "install"),
        pytest.raises(errors.ApplianceError) as e,
        switch_lock(tmp_path, "vllm"),
    ):
        pass
    assert e.value.exit_code == 3
    assert e.value.message.startswith(f"b70ctl install is running (pid {os.getpid()}")
    with (
        switch_lock(tmp_path, "vllm"),
        pytest.raises(errors.ApplianceError) as e,
        writer_lock(tmp_path, "uninstall"),
    ):
        pass
    assert "another switch is running: to vllm" in e.value.message
    assert "`b70ctl uninstall` again" in e.value.hint


def test_a_killed_install_leaves_nothing_to_recover(tmp_path: Path) -> None:
    note = {"command": "install", "pid": 999999999, "pid_start": "1", "started_at": 1.0}
    (tmp_path / NOTE_FILE).write_text(json.dumps(note))
    assert waiting_trace(tmp_path) is None
    with switch_lock(tmp_path, "vllm") as lock:
        assert lock.stale is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["switch.lock"]


class Restarts:
    """What the monitor asks of systemd here: only RestartUnit, recorded."""

    def __init__(self, state_dir: Path) -> None:
        self.scope = Scope.USER
        self.restarted: list[str] = []
        self.state_dir = state_dir

    def restart(self, unit: str) -> None:
        self.restarted.append(unit)


def test_the_monitor_restarts_a_runtime_only_under_the_switch_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A switch that began while the monitor probed (for up to its probe timeouts) may be
    draining the very runtime the monitor judged hung: the restart is left to the switch."""
    from appliance.config import parse
    from tests.conftest import REPO

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    state_dir = tmp_path / "b70"
    cfg = parse((REPO / "examples" / "demo.toml").read_text(), REPO / "examples" / "demo.toml")
    sd = Restarts(state_dir)
    log: list[str] = []
    action = plans.Action("restart", "llamacpp", "no answer to 3 probes")
    with switch_lock(state_dir, "vllm"):
        monitor.act(cfg, Scope.USER, sd, action, Memory(), log.append)  # type: ignore[arg-type]
    assert sd.restarted == []
    assert log[-1] == "restart of llamacpp failed: a switch began meanwhile; llamacpp is left to it"
    with hold.marked(state_dir, "vllm"):  # the lock free, but a switch's hold still marked
        monitor.act(cfg, Scope.USER, sd, action, Memory(), log.append)  # type: ignore[arg-type]
    assert sd.restarted == []
    monitor.act(cfg, Scope.USER, sd, action, Memory(), log.append)  # type: ignore[arg-type]
    assert sd.restarted == ["b70-llamacpp.service"]
