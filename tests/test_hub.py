"""Models by name (`model = "hf:..."`): the config's words, and `b70ctl models pull`, `list` and
`rm` run as a person runs them, against a local folder served over HTTP in the hub's URL layout
(its tree listing with Link pages, /resolve/ by a redirect, Range requests, a gated repository),
since no hub can be reached here. Cuts, a bad hash, a small disk and a gated model are the
server's doing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.config import hub as spec
from appliance.config import parse
from appliance.errors import ConfigError
from b70tools.hubdir import Hub, serve
from tests.configs import GOOD

B70CTL = str(Path(sys.executable).parent / "b70ctl")


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    root = tmp_path / "hub"
    repo = root / "acme" / "tiny-GGUF"
    repo.mkdir(parents=True)
    (repo / "README.md").write_text("# tiny\n")
    (repo / "tiny-Q4_K_M.gguf").write_bytes(os.urandom(300_000))
    (repo / "tiny-Q8_0.gguf").write_bytes(os.urandom(500_000))
    (repo / "mmproj-tiny-Q4_K_M.gguf").write_bytes(os.urandom(1000))
    split = repo / "Q6_K"
    split.mkdir()
    for i in (1, 2):
        (split / f"tiny-Q6_K-0000{i}-of-00002.gguf").write_bytes(os.urandom(200_000))
    hf = root / "acme" / "tiny"
    (hf / "sub").mkdir(parents=True)
    (hf / "config.json").write_text('{"model_type": "llama"}\n')
    (hf / "sub" / "tokenizer.json").write_text("{}\n")
    (hf / "model.safetensors").write_bytes(os.urandom(400_000))
    state = Hub(root)
    server = serve(state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _config(tmp_path: Path, llamacpp: str, vllm: str = "/models/hf") -> Path:
    text = GOOD.replace('model = "/models/m.gguf"', f'model = "{llamacpp}"')
    text = text.replace('model = "/models/hf"', f'model = "{vllm}"')
    text += f'\n[models]\ndir = "{tmp_path / "models"}"\n'
    path = tmp_path / f"appliance-{hashlib.sha256(text.encode()).hexdigest()[:8]}.toml"
    path.write_text(text)
    return path


def b70ctl(config: Path, hub: Hub, *args: str, token: str | None = None) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_ENDPOINT"] = hub.url
    if token:
        env["HF_TOKEN"] = token
    out = subprocess.run([B70CTL, "--user", "--config", str(config), *args], env=env,
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert "Traceback" not in out.stderr, out.stderr
    return out


def test_a_quantization_is_matched_as_a_whole_name_not_inside_another() -> None:
    model = spec.HubModel("acme", "tiny-GGUF", quant="Q4_K_M")
    for path in ("tiny-Q4_K_M.gguf", "tiny.q4_k_m.gguf", "Q4_K_M/tiny-Q4_K_M-00001-of-00002.gguf",
                 "UD-Q4_K_M/tiny-00002-of-00002.gguf"):  # fmt: skip
        assert model.wants(path), path
    for path in ("tiny-IQ4_K_M.gguf", "tiny-Q4_K_M_L.gguf", "tiny-Q4_K_M.bin",
                 "mmproj-tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf"):  # fmt: skip
        assert not model.wants(path), path
    assert not spec.HubModel("acme", "tiny-GGUF", quant="Q4_K").wants("tiny-Q4_K_M.gguf")
    assert spec.HubModel("acme", "tiny-GGUF", quant="UD-Q4_K_XL").wants("tiny-UD-Q4_K_XL.gguf")


def test_hub_names_are_read_or_refused_with_the_forms_they_take(tmp_path: Path) -> None:
    one = spec.parse("hf:acme/tiny-GGUF:Q4_K_M")
    assert one == spec.HubModel("acme", "tiny-GGUF", quant="Q4_K_M")
    assert str(spec.parse("hf:acme/tiny-GGUF/Q6_K/tiny-Q6_K-00002-of-00002.gguf@v1.0")) == (
        "hf:acme/tiny-GGUF/Q6_K/tiny-Q6_K-00002-of-00002.gguf@v1.0"
    )
    for bad in ("hf:acme", "hf:acme/tiny/../x.gguf", "hf:/x/y", "hf:acme/tiny:", "hf:a b/c"):
        assert isinstance(spec.parse(bad), str), bad
    config = parse(_config(tmp_path, "hf:acme/tiny-GGUF/Q6_K/tiny-Q6_K-00002-of-00002.gguf",
                           "hf:acme/tiny").read_text(), tmp_path / "a.toml")  # fmt: skip
    models = tmp_path / "models"
    assert config.models_dir == str(models)
    # the first part of a split file, where llama.cpp finds the others
    split = models / "acme/tiny-GGUF/Q6_K/tiny-Q6_K-00001-of-00002.gguf"
    assert config.runtime("llamacpp").model == str(split)
    assert config.runtime("vllm").model == str(models / "acme" / "tiny")
    with pytest.raises(ConfigError, match=r"runtimes.llamacpp.model: 'hf:acme' is not a hub"):
        parse(_config(tmp_path, "hf:acme").read_text(), tmp_path / "a.toml")
    container = _config(tmp_path, "/models/m.gguf", "hf:acme/tiny").read_text()
    container = container.replace('engine = "vllm"', 'engine = "vllm"\nlauncher = "docker"\n'
                                  'image = "vllm/vllm-openai-xpu:v0.26.0"')  # fmt: skip
    vllm = parse(container, tmp_path / "a.toml").runtime("vllm")
    assert f"{models}/acme/tiny:{models}/acme/tiny:ro" in vllm.volumes


def test_a_pull_fetches_what_the_name_says_checks_it_and_lists_it(tmp_path: Path, hub: Hub) -> None:
    config = _config(tmp_path, "hf:acme/tiny-GGUF:Q4_K_M", "hf:acme/tiny")
    listed = json.loads(b70ctl(config, hub, "models", "list", "--json").stdout)["result"]
    assert [m["pulled"] for m in listed["models"]] == [False, False]
    out = b70ctl(config, hub, "models", "pull")
    assert out.returncode == 0, out.stderr
    assert "llamacpp: hf:acme/tiny-GGUF:Q4_K_M, 1 files" in out.stderr  # the quant, not mmproj
    assert "100.0%" in out.stderr  # the progress, on stderr
    assert "next: `sudo b70ctl install`, so that the unit of llamacpp names" in out.stdout
    models = tmp_path / "models"
    got = sorted(p.relative_to(models).as_posix() for p in models.rglob("*") if p.is_file())
    assert got == ["acme/tiny-GGUF/.b70-pulled.json", "acme/tiny-GGUF/tiny-Q4_K_M.gguf",
                   "acme/tiny/.b70-pulled.json", "acme/tiny/config.json",
                   "acme/tiny/model.safetensors", "acme/tiny/sub/tokenizer.json"]  # fmt: skip
    for rel in ("acme/tiny-GGUF/tiny-Q4_K_M.gguf", "acme/tiny/sub/tokenizer.json"):
        assert (models / rel).read_bytes() == (hub.root / rel).read_bytes()
    listed = json.loads(b70ctl(config, hub, "models", "list", "--json").stdout)["result"]
    assert [m["pulled"] for m in listed["models"]] == [True, True]
    assert listed["models"][0]["path"] == str(models / "acme/tiny-GGUF/tiny-Q4_K_M.gguf")
    again = json.loads(b70ctl(config, hub, "models", "pull", "--json").stdout)["result"]
    assert [m["fetched_bytes"] for m in again["models"]] == [0, 0]  # nothing twice


def test_a_cut_download_goes_on_from_where_it_stopped(tmp_path: Path, hub: Hub) -> None:
    config = _config(tmp_path, "hf:acme/tiny-GGUF:Q8_0")
    hub.cut_after = 123_456
    cut = b70ctl(config, hub, "models", "pull")
    assert cut.returncode == 1
    assert "tiny-Q8_0.gguf stopped at 123456 of 500000 bytes" in cut.stderr, cut.stderr
    assert "run `b70ctl models pull` again" in cut.stderr
    part = tmp_path / "models/acme/tiny-GGUF/tiny-Q8_0.gguf.part"
    assert part.stat().st_size == 123_456
    resumed = b70ctl(config, hub, "models", "pull")
    assert resumed.returncode == 0, resumed.stderr
    assert hub.ranges == ["bytes=123456-"]
    assert not part.exists()
    got = (tmp_path / "models/acme/tiny-GGUF/tiny-Q8_0.gguf").read_bytes()
    assert got == (hub.root / "acme/tiny-GGUF/tiny-Q8_0.gguf").read_bytes()


def test_a_file_that_does_not_match_the_hubs_hash_is_deleted(tmp_path: Path, hub: Hub) -> None:
    config = _config(tmp_path, "hf:acme/tiny-GGUF/Q6_K/tiny-Q6_K-00001-of-00002.gguf")
    hub.corrupt.add("tiny-Q6_K-00002-of-00002.gguf")
    out = b70ctl(config, hub, "models", "pull")
    assert out.returncode == 1 and "does not match the hub's hash" in out.stderr, out.stderr
    folder = tmp_path / "models/acme/tiny-GGUF/Q6_K"
    assert sorted(p.name for p in folder.iterdir()) == ["tiny-Q6_K-00001-of-00002.gguf"]
    assert not (folder.parent / spec.PULLED).exists()  # no record of a model not whole
    hub.corrupt.clear()
    assert b70ctl(config, hub, "models", "pull").returncode == 0
    assert len(list(folder.iterdir())) == 2


def test_what_a_pull_cannot_do_is_named_before_it_starts(tmp_path: Path, hub: Hub) -> None:
    hub.gated.add("acme/tiny")
    config = _config(tmp_path, "/models/m.gguf", "hf:acme/tiny")
    gated = b70ctl(config, hub, "models", "pull", "vllm")
    assert (
        gated.returncode == 1 and "gated or private" in gated.stderr and "HF_TOKEN" in gated.stderr
    )
    assert b70ctl(config, hub, "models", "pull", "vllm", token=hub.token).returncode == 0
    path = b70ctl(config, hub, "models", "pull", "llamacpp")
    assert path.returncode == 1 and "a path, not a model on the hub" in path.stderr
    missing = _config(tmp_path, "hf:acme/nothing-here")
    gone = b70ctl(missing, hub, "models", "pull", "llamacpp")
    assert gone.returncode == 1 and "the hub has no acme/nothing-here" in gone.stderr
    no_quant = _config(tmp_path, "hf:acme/tiny-GGUF:IQ1_S")
    none = b70ctl(no_quant, hub, "models", "pull", "llamacpp")
    assert "no file of acme/tiny-GGUF matches" in none.stderr and "tiny-Q8_0.gguf" in none.stderr
    unreachable = b70ctl(config, Hub(hub.root, port=1), "models", "pull", "vllm")
    assert unreachable.returncode == 1 and "cannot reach the hub" in unreachable.stderr


def test_a_disk_too_small_is_refused_before_a_byte_is_written(
    tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from appliance.host import hub as hub_mod

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    model = spec.HubModel("acme", "tiny-GGUF", quant="Q8_0")
    with hub_mod.client() as http:
        plan = hub_mod.plan(model, str(tmp_path / "models"), http)
        assert plan.to_fetch_bytes == 500_000
        monkeypatch.setattr(hub_mod, "free_bytes", lambda folder: 499_999)
        with pytest.raises(hub_mod.ApplianceError, match=r"needs 0\.5 MiB more") as said:
            hub_mod.pull(plan, http)
    assert said.value.code == "disk_full" and "[models] dir" in (said.value.hint or "")
    assert not (tmp_path / "models").exists()


def test_rm_deletes_what_the_pull_wrote_and_nothing_else(tmp_path: Path, hub: Hub) -> None:
    config = _config(tmp_path, "hf:acme/tiny-GGUF:Q4_K_M")
    assert b70ctl(config, hub, "models", "pull").returncode == 0
    mine = tmp_path / "models/acme/tiny-GGUF/notes.txt"
    mine.write_text("kept")
    out = b70ctl(config, hub, "models", "rm", "llamacpp", "--json")
    assert out.returncode == 0, out.stderr
    removed = json.loads(out.stdout)["result"]["removed"]
    assert sorted(Path(r).name for r in removed) == [spec.PULLED, "tiny-Q4_K_M.gguf"]
    left = sorted(p.relative_to(tmp_path / "models").as_posix()
                  for p in (tmp_path / "models").rglob("*"))  # fmt: skip
    assert left == ["acme", "acme/tiny-GGUF", "acme/tiny-GGUF/notes.txt"]


def test_a_switch_and_doctor_name_what_to_pull_and_its_size(
    tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from appliance.host import doctor
    from appliance.switch import preflight

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    config = parse(_config(tmp_path, "hf:acme/tiny-GGUF:Q8_0").read_text(), tmp_path / "a.toml")
    rt = config.runtime("llamacpp")
    with pytest.raises(preflight.ApplianceError) as said:
        preflight.check_runtime_files(config, rt)
    assert said.value.message == (
        "runtimes.llamacpp.model: hf:acme/tiny-GGUF:Q8_0 is not pulled yet (0.5 MiB to fetch)"
    )
    assert "b70ctl models pull llamacpp" in (said.value.hint or "")
    (check,) = doctor._models(rt, config.models_dir)
    assert not check.ok and check.fix == "sudo b70ctl models pull llamacpp"


def test_a_purge_of_the_state_directory_keeps_a_pulled_model(tmp_path: Path, hub: Hub) -> None:
    """Even with [models] dir inside the state directory, `uninstall --purge` leaves it."""
    from appliance.deploy.purge import purge_state

    state = tmp_path / "state"
    config = _config(tmp_path, "hf:acme/tiny-GGUF:Q4_K_M")
    config.write_text(config.read_text().replace(str(tmp_path / "models"), str(state / "models")))
    assert b70ctl(config, hub, "models", "pull").returncode == 0
    (state / "last-switch.json").write_text("{}")
    purge_state(state)
    assert not (state / "last-switch.json").exists()
    kept = sorted(p.name for p in (state / "models" / "acme" / "tiny-GGUF").iterdir())
    assert kept == [spec.PULLED, "tiny-Q4_K_M.gguf"]


def test_two_quantizations_of_one_repository_share_its_folder_and_not_their_files(
    tmp_path: Path, hub: Hub
) -> None:
    config = _config(tmp_path, "hf:acme/tiny-GGUF:Q4_K_M", "hf:acme/tiny-GGUF:Q8_0")
    assert b70ctl(config, hub, "models", "pull").returncode == 0
    folder = tmp_path / "models/acme/tiny-GGUF"
    listed = json.loads(b70ctl(config, hub, "models", "list", "--json").stdout)["result"]
    paths = {m["runtime"]: m["path"] for m in listed["models"] if m["pulled"]}
    assert paths == {"llamacpp": str(folder / "tiny-Q4_K_M.gguf"),
                     "vllm": str(folder / "tiny-Q8_0.gguf")}  # fmt: skip
    assert b70ctl(config, hub, "models", "rm", "llamacpp").returncode == 0
    assert sorted(p.name for p in folder.iterdir()) == [spec.PULLED, "tiny-Q8_0.gguf"]
    listed = json.loads(b70ctl(config, hub, "models", "list", "--json").stdout)["result"]
    assert [(m["runtime"], m["pulled"]) for m in listed["models"]] == [
        ("llamacpp", False), ("vllm", True)]  # fmt: skip


def test_install_pulls_the_models_first_and_its_units_name_the_file_pulled(
    tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`b70ctl install` fetches a hub model that is not there before it renders anything, with
    its size said and its progress on stderr; the units it writes name the quantization's file."""
    from appliance.deploy import install as install_mod
    from tests.test_cli import _in_process

    reached: list[Any] = []

    def fake(config: Any, scope: Any, now: bool, progress: Any) -> Any:
        reached.append(config)
        return install_mod.InstallResult(scope.value, [], [], False, [], [])

    monkeypatch.setattr(install_mod, "install", fake)
    for key in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    config = _config(tmp_path, "hf:acme/tiny-GGUF:Q8_0")
    argv = ["--user", "--config", str(config), "install", "--no-now"]
    out = _in_process(argv, monkeypatch, capsys)
    assert out.returncode == 0, out.stderr
    assert "llamacpp: hf:acme/tiny-GGUF:Q8_0, 1 files, 0.5 MiB, 0.5 MiB to fetch" in out.stderr
    assert "100.0%" in out.stderr
    pulled = tmp_path / "models/acme/tiny-GGUF/tiny-Q8_0.gguf"
    assert pulled.read_bytes() == (hub.root / "acme/tiny-GGUF/tiny-Q8_0.gguf").read_bytes()
    assert reached[0].runtime("llamacpp").model == str(pulled)
    again = _in_process(argv, monkeypatch, capsys)  # nothing twice
    assert again.returncode == 0 and "to fetch" not in again.stderr


def test_a_projector_named_on_the_hub_is_pulled_with_its_model(tmp_path: Path, hub: Hub) -> None:
    text = _config(tmp_path, "hf:acme/tiny-GGUF:Q4_K_M").read_text()
    text = text.replace('engine = "llamacpp"',
                        'engine = "llamacpp"\nmmproj = "hf:acme/tiny-GGUF/mmproj-tiny-Q4_K_M.gguf"')  # fmt: skip
    config = tmp_path / "with-mmproj.toml"
    config.write_text(text)
    out = b70ctl(config, hub, "models", "pull")
    assert out.returncode == 0, out.stderr
    assert "llamacpp: hf:acme/tiny-GGUF:Q4_K_M, 2 files" in out.stderr
    folder = tmp_path / "models/acme/tiny-GGUF"
    loaded = parse(text, config).runtime("llamacpp")
    assert loaded.model == str(folder / "tiny-Q4_K_M.gguf")  # the weights, not the projector
    assert loaded.mmproj == str(folder / "mmproj-tiny-Q4_K_M.gguf")
    assert (
        Path(loaded.mmproj).read_bytes()
        == (hub.root / "acme/tiny-GGUF/mmproj-tiny-Q4_K_M.gguf").read_bytes()
    )
    gone = text.replace("mmproj-tiny-Q4_K_M.gguf", "mmproj-none.gguf")
    (tmp_path / "gone.toml").write_text(gone)
    out = b70ctl(tmp_path / "gone.toml", hub, "models", "pull")
    assert out.returncode == 1
    assert "acme/tiny-GGUF has no file mmproj-none.gguf (the runtime's mmproj)" in out.stderr
    other = text.replace("hf:acme/tiny-GGUF/mmproj", "hf:acme/tiny/mmproj")
    with pytest.raises(ConfigError, match=r"must name one \.gguf file of the model's own hub"):
        parse(other, config)
