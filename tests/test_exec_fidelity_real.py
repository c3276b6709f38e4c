"""What the config says is exactly what systemd executes.

A property test: random runtime configs whose arguments, environment values and model paths are
full of what unit files treat specially (`%`, `$`, `\\`, quotes, spaces, `;`, non-ASCII text).
Each is written as TOML, loaded, rendered; the rendered unit's own `ExecStart=` and
`Environment=` lines are installed into a real systemd user manager around a recording program,
which writes down the argv and environment it was started with. They must be byte-identical to
what the config asked for.

The seed is printed on failure; B70_FIDELITY_SEED=N runs that case again.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from appliance import config as config_mod
from appliance.layout import Scope, layout
from appliance.units import render, runtimes
from tests.conftest import Manager

CASES = 40
# What unit files, shells and TOML treat specially, and text from outside ASCII.
SPECIAL = [
    "%",
    "%n",
    "%%",
    "$",
    "$HOME",
    "${MAINPID}",
    "$$",
    "\\",
    "\\n",
    '"',
    "'",
    " ",
    ";",
    "=",
    "#",
    "*",
    "~",
    "{",
    "}",
    "`",
    "!",
    "&",
    "|",
    "<",
    ">",
    "é",
    "中文",
    "😀",
    "\u00a0",
]
PLAIN = list("abcXYZ019-_./:,@+")


def random_text(rng: random.Random, min_len: int = 0) -> str:
    parts = [
        rng.choice(SPECIAL if rng.random() < 0.4 else PLAIN)
        for _ in range(rng.randint(min_len, 12))
    ]
    return "".join(parts)


def toml_string(value: str) -> str:
    # A JSON string with non-ASCII kept as it is: a valid TOML basic string.
    return json.dumps(value, ensure_ascii=False)


def random_config(rng: random.Random, recorder: Path) -> tuple[str, list[str], dict[str, str], str]:
    args = [random_text(rng) for _ in range(rng.randint(0, 6))]
    # A leading '-' or a blank model is refused by the config (it would read as a flag).
    model = "/models/" + random_text(rng, 1).strip().lstrip("-") + "x"
    env = {f"B70_T{i}": random_text(rng) for i in range(rng.randint(0, 4))}
    engine = rng.choice(["llamacpp", "vllm"])
    args = [
        a
        for a in args
        if not a.startswith(
            (
                "--host",
                "--port",
                "--model",
                "-m",
                "--alias",
                "-a",
                "--mmproj",
                "--metrics",
                "--served",
                "--shutdown",
            )
        )
    ]
    lines = [
        'default_runtime = "t"',
        "[runtimes.t]",
        f'engine = "{engine}"',
        f"command = [{toml_string(str(recorder))}]",
        f"model = {toml_string(model)}",
        "args = [" + ", ".join(toml_string(a) for a in args) + "]",
        "[runtimes.t.env]",
        *(f"{k} = {toml_string(v)}" for k, v in env.items()),
    ]
    return "\n".join(lines) + "\n", args, env, model


RECORDER = """#!{python}
import json, os, sys
with open(os.environ["B70_RECORD_TO"], "w", encoding="utf-8", errors="surrogateescape") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f, ensure_ascii=True)
"""


def test_argv_and_environment_reach_the_process_byte_for_byte(
    manager: Manager, tmp_path: Path
) -> None:
    seed = int(os.environ.get("B70_FIDELITY_SEED") or time.time_ns() % 1_000_000)
    rng = random.Random(seed)
    recorder = tmp_path / "record"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    unit_dir = Path(manager.env["XDG_CONFIG_HOME"]) / "systemd" / "user"
    lay = layout(Scope.USER)
    cases = []
    for i in range(CASES):
        text, args, env, model = random_config(rng, recorder)
        cfg = config_mod.parse(text, tmp_path / f"case{i}.toml")
        rt = cfg.runtimes["t"]
        assert rt.args == tuple(args) and dict(rt.env) == env and rt.model == model
        unit_text = render.render_runtime_unit(cfg, rt, lay)
        # The rendered unit's own lines, around the recorder: no guards, no health wait.
        kept = [
            line
            for line in unit_text.splitlines()
            if line.startswith(("ExecStart=", "Environment="))
        ]
        out = tmp_path / f"case{i}.json"
        name = f"b70-fidelity-{i}.service"
        (unit_dir / name).write_text(
            "[Service]\nType=oneshot\n"
            f"Environment={render.render_environment('B70_RECORD_TO', str(out))}\n"
            + "\n".join(kept)
            + "\n"
        )
        cases.append((name, out, runtimes.exec_start(cfg, rt), env, args, model, text))
    try:
        manager.systemctl("daemon-reload")
        for name, out, expected_argv, env, args, model, text in cases:
            run = subprocess.run(
                ["systemctl", "--user", "start", name],
                env=manager.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            context = f"seed {seed}, {name}, config:\n{text}"
            assert run.returncode == 0, f"{run.stderr}\n{context}"
            got = json.loads(out.read_text())
            assert got["argv"] == expected_argv[1:], context
            assert got["argv"][-len(args) :] == args if args else True, context
            assert got["argv"][got["argv"].index("--model") + 1] == model, context
            for key, value in env.items():
                assert got["env"].get(key) == value, (key, context)
    finally:
        for name, *_ in cases:
            (unit_dir / name).unlink(missing_ok=True)
        manager.systemctl("daemon-reload")
