"""Every runtime unit keeps its engine's caches where a stop does not lose them: read back from the
rendered unit as systemd and the container engine would read it, for each engine and launcher."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from appliance import config
from appliance.errors import ConfigError
from appliance.layout import Scope, layout
from appliance.units.render import render_all

CACHE_HOME = "/var/cache"  # %C on the system manager

# The variables each engine compiles into (their sources: docs/startup.md), read here from the
# projects' docs, not from the appliance's list.
VLLM_VARS = ["VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "NEO_CACHE_DIR"]
LLAMA_VARS = ["NEO_CACHE_DIR", "SYCL_CACHE_DIR"]

RUNTIMES = {
    "vllm in docker": (
        'engine = "vllm"\nlauncher = "docker"\nimage = "ghcr.io/riceharvest/b70-vllm:v0.31.0-b70.3"\nmodel = "org/m"',
        VLLM_VARS,
    ),
    "vllm in podman": (
        'engine = "vllm"\nlauncher = "podman"\nimage = "docker.io/vllm/vllm-openai-xpu:v0.28.0"\nmodel = "org/m"',
        VLLM_VARS,
    ),
    "vllm native": (
        'engine = "vllm"\ncommand = ["/opt/vllm/bin/vllm", "serve"]\nmodel = "/srv/m"',
        VLLM_VARS,
    ),
    "llama.cpp native": (
        'engine = "llamacpp"\ncommand = ["/opt/llama.cpp/bin/llama-server"]\nmodel = "/srv/m.gguf"\nuser = "b70"',
        LLAMA_VARS,
    ),
    "llama.cpp's image in docker": (
        'engine = "llamacpp"\nlauncher = "docker"\nimage = "ghcr.io/ggml-org/llama.cpp:server-intel-b10820"\nmodel = "/models/m.gguf"\nvolumes = ["/srv/models:/models:ro"]',
        LLAMA_VARS,
    ),
    "llama.cpp's image in podman": (
        'engine = "llamacpp"\nlauncher = "podman"\nimage = "ghcr.io/ggml-org/llama.cpp:server-intel-b10820"\nmodel = "/models/m.gguf"\nvolumes = ["/srv/models:/models:ro"]',
        LLAMA_VARS,
    ),
}


def one_runtime(table: str, extra: str = "") -> str:
    return f'default_runtime = "rt"\n[proxy]\nmodel = "m"\n[runtimes.rt]\n{table}\n{extra}'


def unit_values(text: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def environment(text: str) -> dict[str, str]:
    out = {}
    for value in unit_values(text, "Environment"):
        for word in shlex.split(value.replace("\\\\", "\\")):
            key, _, val = word.partition("=")
            out[key] = val
    return out


def expand(word: str) -> str:
    return word.replace("%C", CACHE_HOME).replace("%%", "%")


def kept_where(text: str, path: str) -> str | None:
    """Where on the host `path` (as the engine sees it) lives past a stop, or None: under the
    unit's CacheDirectory= for a runtime run natively, through a volume from there for a
    container, which `--rm` removes at every stop with everything in it."""
    caches = [f"{CACHE_HOME}/{name}" for name in unit_values(text, "CacheDirectory")]
    argv = [expand(w) for w in shlex.split(unit_values(text, "ExecStart")[0])]
    if len(argv) > 1 and argv[1] == "run":
        host = None
        for i, word in enumerate(argv[:-1]):
            if word in ("--volume", "-v"):
                source, target = argv[i + 1].split(":")[:2]
                if path == target or path.startswith(target + "/"):
                    host = source + path[len(target) :]
        path = host or ""
    if any(path == c or path.startswith(c + "/") for c in caches):
        return path
    return None


@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_every_cache_variable_lands_where_a_stop_does_not_lose_it(name: str) -> None:
    table, names = RUNTIMES[name]
    cfg = config.parse(one_runtime(table), Path("one.toml"))
    unit = render_all(cfg, layout(Scope.SYSTEM))["b70-rt.service"]
    env = environment(unit)
    places = {}
    for var in names:
        assert var in env, f"{name}: {var} is not set"
        where = kept_where(unit, expand(env[var]))
        assert where is not None, f"{name}: {var}={env[var]} is lost at a stop"
        places[var] = where
    # one folder for the recipe, each variable a folder of its own in it
    assert len({Path(p).parent for p in places.values()}) == 1
    assert len(set(places.values())) == len(places)
    # the guard readies that very folder before the start
    guard = [expand(w) for w in shlex.split(unit_values(unit, "ExecStartPre")[-1])]
    assert guard[guard.index("--cache") + 1] == str(Path(next(iter(places.values()))).parent)
    if "docker" in name or "podman" in name:
        argv = shlex.split(unit_values(unit, "ExecStart")[0])
        for var in names:  # the container is told each value from the unit
            assert argv[argv.index(var) - 1] == "--env"
    # the throwaway folders of a start that keeps nothing come through this file
    assert unit_values(unit, "EnvironmentFile") == ["-%t/b70-rt/cache.env"]
    assert unit_values(unit, "RuntimeDirectory") == ["b70-rt"]


def test_a_recipe_changed_is_a_folder_of_its_own() -> None:
    table = RUNTIMES["vllm in docker"][0]
    a = render_all(config.parse(one_runtime(table), Path("a.toml")), layout(Scope.SYSTEM))
    b_text = one_runtime(table.replace("b70.3", "b70.4"))
    b = render_all(config.parse(b_text, Path("b.toml")), layout(Scope.SYSTEM))
    env_a, env_b = environment(a["b70-rt.service"]), environment(b["b70-rt.service"])
    assert env_a["VLLM_CACHE_ROOT"] != env_b["VLLM_CACHE_ROOT"]


def test_a_cache_variable_the_config_sets_stands() -> None:
    table = RUNTIMES["vllm native"][0]
    text = one_runtime(table, '[runtimes.rt.env]\nVLLM_CACHE_ROOT = "/srv/vllm-cache"\n')
    unit = render_all(config.parse(text, Path("own.toml")), layout(Scope.SYSTEM))["b70-rt.service"]
    assert environment(unit)["VLLM_CACHE_ROOT"] == "/srv/vllm-cache"
    guard = unit_values(unit, "ExecStartPre")[-1]
    assert "--cache-var VLLM_CACHE_ROOT" not in guard and "--cache-var TRITON_CACHE_DIR" in guard


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "runtimes.rt.cache_max_gib: -1.0 must not be negative"),
        ('"big"', "runtimes.rt.cache_max_gib"),
    ],
)
def test_a_bad_cache_bound_is_named(value: str, message: str) -> None:
    text = one_runtime(RUNTIMES["vllm native"][0] + f"\ncache_max_gib = {value}")
    with pytest.raises(ConfigError) as e:
        config.parse(text, Path("bad.toml"))
    assert message in str(e.value)
