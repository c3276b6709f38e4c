"""The lasting cache of each runtime (appliance.engines.lasting): the recipe's name, the folders a
start finds, the size bound, the recipes install removes, and what a start's lines say."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from appliance import engines
from appliance.config import Engine, Launcher, RuntimeConfig
from appliance.engines import lasting, vllm

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "starts"
VLLM = engines.of(Engine.VLLM)
LLAMA = engines.of(Engine.LLAMACPP)
BASE = RuntimeConfig(
    name="vllm",
    engine=Engine.VLLM,
    launcher=Launcher.DOCKER,
    model="org/model",
    image="ghcr.io/example/vllm:v1",
    args=("--max-model-len", "16384"),
    env={"B70_LINEAR_FP8_FREE": "1"},
)


@pytest.mark.parametrize(
    "change",
    [
        {"image": "ghcr.io/example/vllm:v2"},
        {"image": "ghcr.io/example/vllm@sha256:" + "0" * 64},
        {"model": "org/other"},
        {"args": ("--max-model-len", "8192")},
        {"env": {"B70_LINEAR_FP8_FREE": "0"}},
        {"engine": Engine.LLAMACPP},
        {"launcher": Launcher.PODMAN},
        {"command": ("/opt/vllm/bin/python",)},
    ],
)
def test_a_different_image_model_or_recipe_is_a_different_folder(change: dict) -> None:
    assert lasting.fingerprint(dataclasses.replace(BASE, **change)) != lasting.fingerprint(BASE)


def test_the_cards_flags_count_and_the_address_does_not() -> None:
    same = dataclasses.replace(BASE, port=9001, served_model_name="other", name="big")
    assert lasting.fingerprint(same) == lasting.fingerprint(BASE)
    two_cards = lasting.fingerprint(BASE, ("--tensor-parallel-size", "2"))
    assert two_cards != lasting.fingerprint(BASE)
    assert lasting.RECIPE.fullmatch(lasting.fingerprint(BASE))


def test_each_variable_points_into_the_recipe_and_the_configs_own_stand() -> None:
    env = lasting.engine_env(VLLM, "/b70-cache/abc", taken={"TRITON_CACHE_DIR"})
    assert env["VLLM_CACHE_ROOT"] == "/b70-cache/abc/vllm"
    assert env["NEO_CACHE_DIR"] == "/b70-cache/abc/neo"
    assert env["NEO_CACHE_PERSISTENT"] == "1"
    assert "TRITON_CACHE_DIR" not in env
    # SYCL's own cache stays off (it segfaults on Xe2): only its folder is given
    assert "SYCL_CACHE_PERSISTENT" not in env and env["SYCL_CACHE_DIR"] == "/b70-cache/abc/sycl"
    assert set(lasting.engine_env(LLAMA, "/x")) == {
        "NEO_CACHE_DIR",
        "NEO_CACHE_PERSISTENT",
        "SYCL_CACHE_DIR",
    }


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_a_first_start_finds_nothing_and_a_second_finds_what_the_first_left(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "b70-vllm" / "0123456789ab"
    env_file = tmp_path / "run" / lasting.ENV_FILE
    first = lasting.prepare(folder, VLLM, ["VLLM_CACHE_ROOT"], 2**30, env_file)
    assert first.verdict == "cold" and not first.problem
    assert "holds nothing yet" in first.line
    for sub in ("vllm", "triton", "inductor", "neo", "sycl"):
        assert (folder / sub).is_dir()  # NEO turns its cache off where the folder is missing
    assert env_file.read_text() == ""  # nothing to change: the unit's own values serve
    graph = folder / "vllm" / "torch_compile_cache" / "f00d" / "rank_0_0" / "backbone"
    graph.mkdir(parents=True)
    (graph / "vllm_compile_cache.py").write_text("x" * 5000)
    second = lasting.prepare(folder, VLLM, ["VLLM_CACHE_ROOT"], 2**30, env_file)
    assert second.verdict == "warm" and second.held_bytes >= 5000
    assert second.line.startswith(f"{lasting.LINE} warm: {folder} holds ")


def test_a_recipe_whose_starts_kept_nothing_is_neither_cold_nor_warm(tmp_path: Path) -> None:
    """llama.cpp on the CPU compiles nothing: once a start succeeded and left the folder empty,
    the next is not called cold again and again."""
    folder = tmp_path / "b70-llamacpp" / "0123456789ab"
    assert lasting.prepare(folder, LLAMA, ["NEO_CACHE_DIR"], 2**30, None).verdict == "cold"
    lasting.mark_started(folder)
    found = lasting.prepare(folder, LLAMA, ["NEO_CACHE_DIR"], 2**30, None)
    assert found.verdict == "none" and "nothing compiles here" in found.line
    judged = lasting.judge_start(found.line, LLAMA)
    assert judged is not None and judged.verdict == "none"
    # a start that compiled fills it: warm from then on
    (folder / "neo" / "ab.l0_cache").write_bytes(b"x")
    assert lasting.prepare(folder, LLAMA, ["NEO_CACHE_DIR"], 2**30, None).verdict == "warm"


def test_a_folder_that_cannot_be_written_starts_cold_and_keeps_nothing(tmp_path: Path) -> None:
    (tmp_path / "b70-vllm").write_text("a file where the folder should be")
    folder = tmp_path / "b70-vllm" / "0123456789ab"
    env_file = tmp_path / "run" / lasting.ENV_FILE
    names = ["VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "NEO_CACHE_DIR"]
    found = lasting.prepare(folder, VLLM, names, 2**30, env_file)
    assert found.verdict == "cold"
    assert "cannot be written (Not a directory)" in found.line
    assert "keeps nothing" in found.line
    assert read_env(env_file) == {
        "VLLM_CACHE_ROOT": f"{lasting.COLD_ROOT}/vllm",
        "TRITON_CACHE_DIR": f"{lasting.COLD_ROOT}/triton",
        "NEO_CACHE_DIR": f"{lasting.COLD_ROOT}/neo",
        "VLLM_DISABLE_COMPILE_CACHE": "1",
    }


def test_a_disk_too_full_for_a_starts_artifacts_starts_cold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stat = os.statvfs(tmp_path)
    free = stat.f_bavail * stat.f_frsize
    monkeypatch.setattr(lasting, "FREE_FLOOR_BYTES", free + 2**40)
    found = lasting.prepare(tmp_path / "c" / "0123456789ab", LLAMA, ["NEO_CACHE_DIR"], 2**30, None)
    assert found.verdict == "cold" and "free on its disk, less than the" in found.problem


def test_no_cache_at_all_when_its_bound_is_zero(tmp_path: Path) -> None:
    env_file = tmp_path / lasting.ENV_FILE
    found = lasting.prepare(tmp_path / "c" / "0123456789ab", LLAMA, ["NEO_CACHE_DIR"], 0, env_file)
    assert "is off (cache_max_gib = 0)" in found.line
    assert read_env(env_file) == {"NEO_CACHE_DIR": f"{lasting.COLD_ROOT}/neo"}
    assert not (tmp_path / "c").exists()


def fill(path: Path, nbytes: int, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(nbytes))
    os.utime(path, (mtime, mtime))


def test_the_bound_drops_the_least_recently_used_recipe_first_then_the_oldest_entries(
    tmp_path: Path,
) -> None:
    root = tmp_path / "b70-vllm"
    old, newer, current = (root / name for name in ("aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"))
    for folder, used in ((old, 1000.0), (newer, 2000.0)):
        fill(folder / "vllm" / "torch_compile_cache" / "h1" / "graph", 400_000, used)
        fill(folder / lasting.STAMP, 0, used)
    fill(current / "triton" / "k-old" / "kernel", 300_000, 100.0)
    fill(current / "triton" / "k-new" / "kernel", 300_000, 3000.0)
    fill(current / "neo" / "a.l0_cache", 100_000, 2500.0)
    fill(current / lasting.STARTED, 0, 3000.0)
    mine = root / "notes"  # not a recipe's: never counted, never removed
    fill(mine / "readme", 10, 1.0)
    bound = 500_000
    dropped = lasting.bound(root, bound, keep=current, facts=VLLM)
    assert dropped[0].startswith("aaaaaaaaaaaa")
    assert not old.exists() and not newer.exists()
    assert not (current / "triton" / "k-old").exists()  # the oldest of the current recipe's
    assert (current / "triton" / "k-new" / "kernel").exists()
    assert (current / "neo" / "a.l0_cache").exists()
    assert (mine / "readme").exists()
    assert lasting.size_of(current) <= bound
    assert not (current / lasting.STARTED).exists()  # less than its starts left: not warm


def test_install_removes_the_recipes_no_longer_installed_and_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "b70-llamacpp"
    for name in ("aaaaaaaaaaaa", "bbbbbbbbbbbb", "models", "ABCDEFABCDEF"):
        (root / name).mkdir(parents=True)
    (root / "cccccccccccc").symlink_to(tmp_path)
    removed = lasting.prune(root, keep={"bbbbbbbbbbbb"})
    assert [p.name for p in removed] == ["aaaaaaaaaaaa"]
    assert sorted(p.name for p in root.iterdir()) == [
        "ABCDEFABCDEF",
        "bbbbbbbbbbbb",
        "cccccccccccc",
        "models",
    ]


# --- what a start's lines say --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "verdict", "init", "compile_s"),
    [
        # vLLM 0.23 on two B70s (hotschmoe/b70_ai_things; the compile lines are vLLM 0.24's words)
        (
            "init engine (profile, create kv cache, warmup model) took 228.37 s (compilation: 208.52 s)",
            "",
            228.37,
            208.52,
        ),
        (
            "init engine (profile, create kv cache, warmup model) took 49.46 seconds",
            "",
            49.46,
            None,
        ),
    ],
)
def test_vllms_init_line_in_each_releases_words(
    line: str, verdict: str | None, init: float, compile_s: float | None
) -> None:
    found = vllm.read_start(line)
    assert found is not None
    assert (found.init_s, found.compile_s) == (init, compile_s)
    if verdict is not None:
        assert found.verdict == verdict


def test_a_load_failure_is_cold_with_vllms_reason_however_full_the_folder() -> None:
    text = (
        "b70 cache: warm: /var/cache/b70-vllm/0123456789ab holds 210.0 MiB from earlier starts\n"
        "WARNING [decorators.py:300] Compiling model again due to a load failure from "
        "/b70-cache/0123456789ab/vllm/torch_compile_cache/torch_aot_compile/ab/rank_0_0/model, "
        "reason: 'function' object has no attribute 'finalize_loading'\n"
        "INFO [backends.py:900] Compiling a graph for compile range (1, 2048) takes 21.31 s\n"
        "INFO [core.py:300] init engine (profile, create kv cache, warmup model) took 59.90 s "
        "(compilation: 40.10 s)\n"
    )
    found = lasting.judge_start(text, VLLM)
    assert found is not None and found.verdict == "cold"
    assert "could not load its compile cache ('function' object has no attribute" in found.cause
    assert (found.init_s, found.compile_s) == (59.9, 40.1)


def test_a_guard_that_could_not_use_the_folder_outranks_the_engine() -> None:
    text = (
        f"{lasting.LINE} cold: /var/cache/b70-vllm/0123456789ab cannot be written (Permission "
        "denied); this start keeps nothing\n"
        "init engine (profile, create kv cache, warmup model) took 70.00 s (compilation: 50.0 s)\n"
    )
    found = lasting.judge_start(text, VLLM)
    assert found is not None and found.verdict == "cold"
    assert found.cause == "the cache cannot be written (Permission denied)"


def test_llama_cpp_says_nothing_so_the_guard_decides() -> None:
    warm = f"{lasting.LINE} warm: /x/0123456789ab holds 3.0 MiB from earlier starts\nmain: loaded"
    found = lasting.judge_start(warm, LLAMA)
    assert found is not None and (found.verdict, found.cause) == ("warm", "")
    cold = f"{lasting.LINE} cold: /x/0123456789ab holds nothing yet; this start fills it"
    found = lasting.judge_start(cold, LLAMA)
    assert found is not None and (found.verdict, found.cause) == ("cold", "nothing kept yet")
    assert lasting.judge_start("main: loaded", LLAMA) is None


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.log")))
def test_real_vllm_starts_read_as_they_were(name: str) -> None:
    """Starts of the real vLLM (CPU build 0.32.0), its lines as it printed them: the file's name
    says what the start was (cold, a cache vLLM could not load, or silent about its cache)."""
    expected = name.split("-")[0]
    found = vllm.read_start((FIXTURES / name).read_text())
    assert found is not None and found.init_s is not None
    assert found.verdict == {"cold": "cold", "failed": "cold", "silent": ""}[expected]
    if expected == "failed":
        assert "could not load its compile cache ('function' object has no" in found.cause
    # where vLLM is silent, the guard's line decides, and vLLM's times stay
    guard = (
        f"{lasting.LINE} warm: /var/cache/b70-vllm/5f0c2a9e41d7 holds 4.5 MiB from earlier starts\n"
    )
    judged = lasting.judge_start(guard + (FIXTURES / name).read_text(), VLLM)
    assert judged is not None and judged.init_s == found.init_s
    assert judged.verdict == ("warm" if expected == "silent" else "cold")


def test_a_recipe_that_compiles_nothing_starts_neither_cold_nor_warm() -> None:
    text = (
        f"{lasting.LINE} cold: /x/0123456789ab holds nothing yet; this start fills it\n"
        "init engine (profile, create kv cache, warmup model) took 27.10 s\n"
    )
    assert not VLLM.compiles(["--enforce-eager", "--max-model-len", "2048"])
    found = lasting.judge_start(text, VLLM, compiles=False)
    assert found is not None and (found.verdict, found.init_s) == ("none", 27.1)


# --- what a swap costs, cold and warm --------------------------------------------------------------


def switch_record(seconds: float, verdict: str | None, cause: str | None = None) -> dict:
    record = {"to": "vllm", "ok": True, "seconds": seconds, "at": 1.0, "phases": {"drained": 1.0}}
    if verdict:
        record["start"] = {"verdict": verdict, "cause": cause}
    return record


def test_the_expected_swap_is_the_warm_one_once_the_cache_is_warm() -> None:
    from appliance.switch.records import swap_costs, swap_figures

    runtimes = {"vllm": BASE}
    history = [switch_record(229.0, "cold", "nothing to load yet"), switch_record(18.0, "warm")]
    figures, _ = swap_figures(history, runtimes)
    assert (figures["vllm"].cold, figures["vllm"].warm) == (228.0, 17.0)
    assert swap_costs(history, runtimes)[0] == {"vllm": 17.0}
    # only a cold start so far: it filled the cache, but no warm figure is known yet
    assert swap_costs(history[:1], runtimes)[0] == {"vllm": 228.0}
    # a start that could not use its cache kept nothing: the next is cold again
    broken = [*history, switch_record(231.0, "cold", "the cache cannot be written (Read-only)")]
    assert swap_costs(broken, runtimes)[0] == {"vllm": 230.0}
    # records from before starts were judged count as they did
    assert swap_costs([switch_record(50.0, None)], runtimes)[0] == {"vllm": 49.0}


def test_a_hold_shorter_than_the_costliest_swap_on_record_is_a_warning(tmp_path: Path) -> None:
    import json

    from appliance import config
    from appliance.deploy.warm import hold_warnings
    from appliance.layout import Layout, Scope

    text = (
        'default_runtime = "llamacpp"\n[proxy]\nmodel = "m"\nhold_s = 120\n'
        '[runtimes.llamacpp]\nengine = "llamacpp"\ncommand = ["/usr/bin/true"]\nmodel = "/m.gguf"\n'
        '[runtimes.vllm]\nengine = "vllm"\nmodel = "/models/hf"\n'
    )
    cfg = config.parse(text, Path("hold.toml"))
    lay = Layout(Scope.USER, tmp_path / "units", tmp_path / "etc", tmp_path / "state")
    assert hold_warnings(cfg, lay) == []  # nothing on record: nothing to compare
    lay.state_dir.mkdir()
    history = [switch_record(229.0, "cold", "nothing to load yet")]
    (lay.state_dir / "switches.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    (warning,) = hold_warnings(cfg, lay)
    assert warning.startswith("[proxy] hold_s = 120 s is shorter than a swap to vllm (228 s")
    # once a warm start is on record, the warm one is what a swap is expected to take
    history.append(switch_record(18.0, "warm"))
    (lay.state_dir / "switches.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    assert hold_warnings(cfg, lay) == []
