"""The appliance of examples/b70.toml on the B70 stand-in (b70tools.b70_engine): the same
runtimes, flags and env, each engine replaced by the stand-in run natively, its model a
config.json of Qwen3.6-35B-A3B's geometry (tests/fixtures/b70) and a GGUF of the size the
stand-in is told. For the suite and the benchmarks, at a B70's times scaled by `scale`."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG_JSON = REPO / "tests" / "fixtures" / "b70" / "Qwen-Qwen3.6-35B-A3B.json"
GGUF_GIB = 19.7  # Qwen3.6-35B-A3B Q4_K_M: its file's size, which the stand-in loads and holds


def prepare_models(where: Path) -> tuple[Path, Path]:
    """A model folder with the config.json, and a small GGUF file, under `where`."""
    model = where / "qwen3.6-35b-a3b"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(CONFIG_JSON.read_text())
    gguf = where / "Qwen3.6-35B-A3B-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    return model, gguf


def _toml(value: object) -> str:
    return json.dumps(value)  # TOML's basic strings and arrays of them are JSON's


def standin_text(
    proxy_port: int, backend_port: int, monitor_port: int, models: Path, scale: float,
    extra: str = "", python: str = sys.executable, names: dict[str, tuple[str, int]] | None = None,
) -> str:  # fmt: skip
    """examples/b70.toml's runtimes on the stand-in, on loopback and these ports; `names`: a
    runtime's own served model name and port (runtime -> (name, port)), for switching on
    demand between them."""
    b70 = tomllib.loads((REPO / "examples" / "b70.toml").read_text())
    model, gguf = prepare_models(models)
    common = {"PYTHONPATH": str(REPO), "B70_STANDIN_SCALE": f"{scale:g}"}
    lines = [
        f'default_runtime = "{b70["default_runtime"]}"',
        "[proxy]", 'host = "127.0.0.1"', f"port = {proxy_port}",
        f'model = "{b70["proxy"]["model"]}"', 'aliases = ["default"]', "hold_s = 900",
        "[backend]", 'host = "127.0.0.1"', f"port = {backend_port}",
        "[gpu]", 'device = "auto"', "release_timeout_s = 120",
    ]  # fmt: skip
    if "[monitor]" not in extra:
        lines += ["[monitor]", f"port = {monitor_port}", "interval_s = 1"]
    for name, rt in b70["runtimes"].items():
        engine = rt["engine"]
        env = {**rt.get("env", {}), **common}
        if engine == "llamacpp":
            env["B70_STANDIN_LLAMA_GIB"] = f"{GGUF_GIB:g}"
        lines += [
            f"[runtimes.{name}]",
            f'engine = "{engine}"',
            *(
                [f'served_model_name = "{names[name][0]}"', f"port = {names[name][1]}"]
                if names and name in names
                else []
            ),
            f"command = {_toml([python, '-m', 'b70tools.b70_engine', engine])}",
            f"model = {_toml(str(model if engine == 'vllm' else gguf))}",
            f"start_timeout_s = {rt['start_timeout_s']}",
            f"memory_needed_gib = {rt['memory_needed_gib']}",
            f"args = {_toml(rt['args'])}",
            f"[runtimes.{name}.env]",
            *(f"{k} = {_toml(v)}" for k, v in env.items()),
        ]
    return "\n".join(lines) + "\n" + extra
