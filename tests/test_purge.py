"""`uninstall --purge` in the state directory: the appliance's files go, a person's stay."""

from __future__ import annotations

import os
from pathlib import Path

from appliance import hold, layout
from appliance.deploy.purge import STATE_FILES, purge_state


def appliance_files(state: Path) -> None:
    for name in STATE_FILES:
        (state / name).write_text("{}")
    (state / f".{layout.HISTORY}.0123456789ab").write_text("half")  # its writer died
    held = state / hold.HELD_DIR
    held.mkdir()
    for name in ("4242.json", "4242-8001.json", "open", "open-8000", ".open-8000.00112233aabb",
                 "turns-8001.json", "turns-8001.db", "turns-8001.db-wal", "turns-8001.db-shm",
                 "turns-8001.lock", "keys-fleet.json"):  # fmt: skip
        (held / name).write_text("1")
    for folder, names in (("usage", ["4242.jsonl"]), ("keys", ["alice.json", "alice.lock"])):
        (held / folder).mkdir()
        for name in names:
            (held / folder / name).write_text("1")


def test_the_owners_models_and_notes_stay(tmp_path: Path) -> None:
    state = tmp_path / "b70"
    state.mkdir()
    appliance_files(state)
    models = state / "models"
    models.mkdir()
    (models / "small.gguf").write_bytes(b"GGUF")
    (state / "README.txt").write_text("mine")
    (state / "switches.jsonl.old").write_text("mine too")
    (state / "hf").symlink_to(models)
    out = purge_state(state)
    assert sorted(p.name for p in state.iterdir()) == [
        "README.txt",
        "hf",
        "models",
        "switches.jsonl.old",
    ]
    assert (models / "small.gguf").read_bytes() == b"GGUF"
    assert str(state / "models") in out.kept and str(state / "README.txt") in out.kept
    assert str(state / hold.HELD_DIR) in out.removed
    assert out.failed == []


def test_a_read_only_model_folder_is_not_entered(tmp_path: Path) -> None:
    state = tmp_path / "b70"
    state.mkdir()
    appliance_files(state)
    models = state / "models"
    models.mkdir()
    (models / "big.gguf").write_bytes(b"GGUF")
    models.chmod(0o555)  # as a read-only mount is, for root too: never written
    try:
        out = purge_state(state)
    finally:
        models.chmod(0o755)
    assert out.failed == [] and (models / "big.gguf").exists()


def test_a_state_directory_of_the_appliance_alone_goes_whole(tmp_path: Path) -> None:
    state = tmp_path / "b70"
    state.mkdir()
    appliance_files(state)
    out = purge_state(state)
    assert not state.exists()
    assert out.kept == [] and out.failed == [] and str(state) in out.removed


def test_a_missing_state_directory_is_nothing_to_do(tmp_path: Path) -> None:
    out = purge_state(tmp_path / "never")
    assert (out.removed, out.kept, out.failed) == ([], [], [])


def test_the_files_the_proxy_makes_are_the_ones_purge_knows(tmp_path: Path) -> None:
    """The proxy's names come from its own room, which deploy may not import: the patterns here
    are written out, and this holds them to the proxy's."""
    from appliance import usage
    from appliance.deploy.purge import HELD_FILE, HELD_FOLDERS, ours
    from appliance.proxy.share import limits, turns

    assert ours(turns.Record(tmp_path, 8001).path.name, HELD_FILE)
    assert ours(turns.Record(tmp_path, None).path.name, HELD_FILE)
    assert limits.KEYS_DIR in HELD_FOLDERS and ours("alice.json", HELD_FOLDERS[limits.KEYS_DIR])
    assert ours("alice.lock", HELD_FOLDERS[limits.KEYS_DIR])
    assert ours(f"{os.getpid()}.jsonl", HELD_FOLDERS[usage.USAGE_DIR])
