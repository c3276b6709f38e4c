"""`b70ctl doctor` on fixture trees: a healthy two-B70 host, then each failure on its own."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.host import doctor, modelfiles
from b70tools import gpu_trees as t
from tests.test_cli import _in_process


def gguf_bytes(tensors: list[tuple[str, list[int], int, int]], alignment: int = 32) -> bytes:
    """A GGUF v3 file: one metadata key (general.alignment), then the tensors' infos and data."""

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 2)
    out += string("general.alignment") + struct.pack("<II", 4, alignment)
    out += string("general.tags") + struct.pack("<IIQ", 9, 8, 2) + string("a") + string("bc")
    end = 0
    for name, dims, kind, offset in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", kind, offset)
        per_block, block_bytes = modelfiles.GGML_TYPES[kind]
        count = 1
        for d in dims:
            count *= d
        end = max(end, offset + -(-count // per_block) * block_bytes)
    start = -(-len(out) // alignment) * alignment
    return out + b"\0" * (start - len(out) + end)


def safetensors_bytes() -> bytes:
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F16", "shape": [8], "data_offsets": [16, 32]},
        }
    ).encode()
    return struct.pack("<Q", len(header)) + header + b"\1" * 32


GGUF = [("tok", [64, 4], 0, 0), ("blk.0.q", [256, 2], 12, 1024)]  # F32, then Q4_K


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


class Host:
    """A healthy host: two B70s under xe, kernel 7.1, the render group, by-path links, root's
    capabilities, 128 GiB, docker that answers and has the image, the models whole."""

    def __init__(
        self, tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        self.monkeypatch, self.capsys = monkeypatch, capsys
        self.root = t.healthy_host(
            tmp / "root", ["0000:03:00.0", "0000:07:00.0"], memory_kib=128 * 1024**2
        )
        self.bin = tmp / "bin"
        self.calls = tmp / "calls"
        self.docker = executable(
            self.bin / "docker",
            f'#!/bin/sh\necho "$@" >> {self.calls}\n'
            'case "$1" in info) exit ${DOCKER_INFO_RC:-0};;\n'
            '  image) [ -n "$DOCKER_NO_IMAGE" ] && { echo "No such image" >&2; exit 1; }\n'
            "    echo sha256:0123456789abcdef0123;; esac\n",
        )
        executable(
            self.bin / "ldd",
            f'#!/bin/sh\necho "ldd $@" >> {self.calls}\n'
            'echo "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)"\n'
            '[ -n "$LDD_MISSING" ] && echo "\tlibsycl.so.8 => not found"\nexit 0\n',
        )
        self.server = executable(tmp / "llama.cpp" / "llama-server", "#!/bin/sh\n")
        models = tmp / "models"
        models.mkdir()
        self.gguf = models / "m.gguf"
        self.gguf.write_bytes(gguf_bytes(GGUF))
        snapshot = tmp / "hf" / "hub" / "models--org--tp-model" / "snapshots" / "abc123"
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
        self.safetensors = snapshot / "model-00001-of-00001.safetensors"
        self.safetensors.write_bytes(safetensors_bytes())
        self.config_path = tmp / "appliance.toml"
        self.text = f"""
default_runtime = "tp"
b70ctl = "/opt/b70/bin/b70ctl"
docker = "{self.docker}"
[gpu]
cards = "auto"
[runtimes.tp]
cards = [0, 1]
engine = "vllm"
model = "org/tp-model"
launcher = "docker"
image = "ghcr.io/x/vllm:1"
volumes = ["{tmp / "hf"}:/root/.cache/huggingface"]
args = ["--cpu-offload-gb", "4"]
[runtimes.llamacpp]
engine = "llamacpp"
command = ["{self.server}"]
model = "{self.gguf}"
user = "b70"
cards = [1]
"""

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def run(self, *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
        """b70ctl doctor, in this process (the programs it asks find the stubs on PATH)."""
        self.config_path.write_text(self.text)
        with self.monkeypatch.context() as m:
            m.setenv("PATH", f"{self.bin}:{os.environ['PATH']}")
            for key, value in env.items():
                m.setenv(key, value)
            argv = ["--config", str(self.config_path), "doctor", "--root", str(self.root)]
            return _in_process([*argv, *extra], m, self.capsys)

    def checks(self, **env: str) -> dict[str, list[dict[str, object]]]:
        out = self.run("--json", **env)
        doc = json.loads(out.stdout)  # one document, in the --json envelope
        assert set(doc) == {"version", "ok", "result" if doc["ok"] else "error"}
        found = doc["result"]["checks"] if doc["ok"] else doc["error"]["details"]["checks"]
        assert (out.returncode == 0) == doc["ok"] == all(c["ok"] for c in found)
        by_name: dict[str, list[dict[str, object]]] = {}
        for c in found:
            by_name.setdefault(str(c["name"]), []).append(c)
        return by_name

    def failed(self, **env: str) -> dict[str, list[dict[str, object]]]:
        return {
            n: [c for c in cs if not c["ok"]]
            for n, cs in self.checks(**env).items()
            if any(not c["ok"] for c in cs)
        }


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Host]:
    """In a folder every user may enter, as a B70 owner's /srv and /opt are: doctor opens the
    models as the runtime's user (pytest's own folders are root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="b70-doctor-"))
    try:
        base.chmod(0o755)
        yield Host(base, monkeypatch, capsys)
    finally:
        shutil.rmtree(base)


def test_a_healthy_host_passes_every_check(host: Host) -> None:
    checks = host.checks()
    assert all(c["ok"] for cs in checks.values() for c in cs), checks
    assert set(checks) == {
        "cards",
        "xe driver",
        "kernel",
        "render group",
        "/dev/dri/by-path",
        "CAP_PERFMON",
        "llamacpp: libraries",
        "llamacpp: model",
        "llamacpp: as b70",
        "tp: docker",
        "tp: image",
        "tp: model",
        "tp: host memory",
        "tp: fits",
        # each runtime's compile cache: informational, never a failure (docs/caches.md)
        "llamacpp: cache",
        "tp: cache",
    }
    assert checks["tp: cache"][0]["detail"].startswith("cold: no start of the installed recipe")
    assert "IGC_" not in str(checks["tp: cache"])


def test_an_igc_variable_is_named_for_the_kernel_cache_it_turns_off(host: Host) -> None:
    host.text = host.text.replace(
        'engine = "llamacpp"', 'engine = "llamacpp"\nenv = { IGC_EnableDPEmulation = "1" }', 1
    )
    checks = host.checks()
    (cache,) = checks["llamacpp: cache"]
    assert cache["ok"]
    assert "warning: IGC_EnableDPEmulation set: Intel's compute runtime 25.31 to 26.31" in str(
        cache["detail"]
    )
    assert len(checks["xe driver"]) == 2
    calls = host.calls.read_text()
    assert "image inspect --format {{.Id}} ghcr.io/x/vllm:1" in calls
    assert f"ldd {host.server}" in calls
    text = host.run()
    assert text.returncode == 0 and "FAIL" not in text.stdout


def one_failure(host: Host, name: str, **env: str) -> dict[str, object]:
    failed = host.failed(**env)
    assert list(failed) == [name], failed
    assert len(failed[name]) == 1
    return failed[name][0]


def test_a_model_only_root_can_read_fails_as_the_runtimes_user(host: Host) -> None:
    host.gguf.chmod(0o600)  # root reads it; b70 (uid 990 in the fixture's passwd) cannot
    check = one_failure(host, "llamacpp: as b70")
    assert f"b70 cannot read {host.gguf} (mode -rw-------" in str(check["detail"])
    assert "chmod o+r" in str(check["fix"])


def test_a_model_in_a_folder_the_user_cannot_enter(host: Host) -> None:
    host.gguf.parent.chmod(0o700)  # as /root is
    check = one_failure(host, "llamacpp: as b70")
    assert f"b70 cannot enter {host.gguf.parent} (mode drwx------" in str(check["detail"])


def test_a_model_the_users_group_may_read_passes(host: Host) -> None:
    host.gguf.chmod(0o640)
    os.chown(host.gguf, 0, 105)  # the render group, which the unit gives the runtime
    checks = host.checks()
    assert checks["llamacpp: as b70"][0]["ok"], checks["llamacpp: as b70"]


def test_a_user_not_made_yet_is_judged_as_anyone(host: Host) -> None:
    host.write("etc/passwd", "root:x:0:0::/root:/bin/sh\n")
    checks = host.checks()
    assert "b70 does not exist yet" in str(checks["llamacpp: as b70"][0]["detail"])
    host.gguf.chmod(0o600)
    assert "b70 cannot read" in str(one_failure(host, "llamacpp: as b70")["detail"])


def test_a_card_without_xe(host: Host) -> None:
    uevent = next(host.root.glob("sys/devices/**/0000:07:00.0/uevent"))
    uevent.write_text(uevent.read_text().replace("DRIVER=xe", "DRIVER=i915"))
    check = one_failure(host, "xe driver")
    assert "0000:07:00.0: bound to i915, not xe" in str(check["detail"])


def test_a_kernel_before_7_1_fails_only_where_a_runtime_spans_cards(host: Host) -> None:
    host.write("proc/sys/kernel/osrelease", "6.14.0-37-generic\n")
    check = one_failure(host, "kernel")
    assert "tp run on several cards" in str(check["detail"]) and "7.1" in str(check["fix"])
    host.text = host.text.replace("cards = [0, 1]", "cards = [1]").replace(
        '["--cpu-offload-gb", "4"]', "[]"
    )
    assert host.checks()["kernel"][0]["ok"]


def test_no_render_group_and_a_runtime_user_outside_it(host: Host) -> None:
    host.write("etc/group", "root:x:0:\nrender:x:105:\n")
    assert "b70 exist(s) but not in the render group" in str(
        one_failure(host, "render group")["detail"]
    )
    host.write("etc/group", "root:x:0:\n")
    assert "there is no render group" in str(one_failure(host, "render group")["detail"])


def test_a_missing_by_path_link(host: Host) -> None:
    (host.root / "dev/dri/by-path/pci-0000:07:00.0-render").unlink()
    assert "0000:07:00.0" in str(one_failure(host, "/dev/dri/by-path")["detail"])


def test_no_cap_perfmon(host: Host) -> None:
    status = host.root / "proc/self/status"
    status.write_text(status.read_text().replace(t.ROOT_CAPS, t.USER_CAPS))
    assert "used VRAM as 0" in str(one_failure(host, "CAP_PERFMON")["detail"])


def test_docker_that_does_not_answer_or_lacks_the_image(host: Host) -> None:
    assert "info" in str(one_failure(host, "tp: docker", DOCKER_INFO_RC="1")["detail"])
    check = one_failure(host, "tp: image", DOCKER_NO_IMAGE="1")
    assert "docker pull ghcr.io/x/vllm:1" in str(check["fix"])
    host.docker.unlink()
    assert "is not installed" in str(one_failure(host, "tp: docker")["detail"])


def test_models_cut_short_or_absent(host: Host) -> None:
    data = host.gguf.read_bytes()
    host.gguf.write_bytes(data[:-10])
    check = one_failure(host, "llamacpp: model")
    assert f"{len(data) - 10} of the {len(data)} bytes" in str(check["detail"])
    host.gguf.write_bytes(data)
    host.safetensors.write_bytes(safetensors_bytes()[:-1])
    assert "cut short" in str(one_failure(host, "tp: model")["detail"])
    host.safetensors.write_bytes(b"not a model")
    assert "does not fit" in str(one_failure(host, "tp: model")["detail"])
    host.text = host.text.replace("org/tp-model", "org/other")
    assert "not in the Hugging Face cache" in str(one_failure(host, "tp: model")["detail"])


def test_llama_server_libraries_that_do_not_resolve(host: Host) -> None:
    check = one_failure(host, "llamacpp: libraries", LDD_MISSING="1")
    assert "needs libsycl.so.8" in str(check["detail"]) and "oneAPI" in str(check["fix"])


def test_too_little_host_memory_for_the_offload(host: Host) -> None:
    host.write("proc/meminfo", "MemTotal:       8388608 kB\n")
    check = one_failure(host, "tp: host memory")
    assert "8.0 GiB in all for --cpu-offload-gb 4" in str(check["detail"])


def test_a_recipe_that_cannot_hold_one_request_fails_with_its_fix(host: Host) -> None:
    """The model's config.json is Qwen3.8-27B's; unquantized at 262,144 tokens on two cards it
    cannot hold one request (the runtime's two cards make it tensor parallel over two); the fix
    names the longest --max-model-len that fits."""
    config = Path(__file__).parent / "fixtures" / "b70" / "Qwen-Qwen3.8-27B.json"
    (host.safetensors.parent / "config.json").write_text(config.read_text())
    host.text = host.text.replace(
        'args = ["--cpu-offload-gb", "4"]',
        'args = ["--cpu-offload-gb", "4", "--max-model-len", "262144", '
        '"--gpu-memory-utilization", "0.92", "--max-num-seqs", "8"]',
    )
    check = one_failure(host, "tp: fits")
    assert "runtimes.tp cannot hold one request of --max-model-len 262144" in str(check["detail"])
    assert "set --max-model-len " in str(check["fix"])
    host.text = host.text.replace("262144", "8192")
    assert host.failed() == {}


def test_tensor_parallel_vllm_wants_host_memory_as_large_as_its_cards(host: Host) -> None:
    """Two B70s at TP 2 on a 64 GB host: OOM-killed (intel/llm-scaler#672)."""
    host.write("proc/meminfo", "MemTotal:       67108864 kB\n")
    check = one_failure(host, "tp: host memory")
    assert (
        "64.0 GiB in all for --cpu-offload-gb 4 plus 64 GiB as large as its 2 cards' VRAM"
        in str(check["detail"])
    )


DPKG = """Package: libze1
Status: install ok installed
Version: 1.28.2-1

Package: libze-intel-gpu1
Status: install ok installed
Architecture: amd64
Version: {version}
Description: Intel(R) Graphics Compute Runtime for oneAPI Level Zero
 a continuation line: no field
"""


def test_a_compute_runtime_older_than_26_18_fails_with_the_version_to_install(host: Host) -> None:
    host.write("var/lib/dpkg/status", DPKG.format(version="25.48.36300.8-1"))
    check = one_failure(host, "compute runtime")
    assert "libze-intel-gpu1 25.48.36300.8-1 is older than 26.18" in str(check["detail"])
    assert "compute runtime 26.18 or later" in str(check["fix"])
    host.write("var/lib/dpkg/status", DPKG.format(version="26.18.38308.1-1"))
    checks = host.checks()
    assert checks["compute runtime"][0]["ok"] and not host.failed()


def test_no_b70_at_all(host: Host, tmp_path: Path) -> None:
    host.root = t.build(tmp_path / "empty", [], [])
    checks = host.failed()
    assert "no B70 in sysfs" in str(checks["cards"][0]["detail"])


def test_the_text_report_gives_each_failure_its_fix(host: Host) -> None:
    host.write("proc/meminfo", "MemTotal:       8388608 kB\n")
    out = host.run()
    assert out.returncode == 1
    assert "FAIL tp: host memory: " in out.stdout
    assert "     fix: lower --cpu-offload-gb, or add memory" in out.stdout
    assert "error: 1 of 17 checks failed: tp: host memory" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "data",
    [
        b"GGUF",
        b"GGUF" + struct.pack("<I", 9),
        b"GGML" + b"\0" * 40,
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1),
    ],
)
def test_broken_gguf_headers_are_named_not_raised(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    with pytest.raises(modelfiles.BadModel):
        modelfiles.check(path)


def test_the_checks_read_real_model_files_exactly() -> None:
    """The demo's models, when fetched: their headers promise exactly their sizes."""
    cache = Path(os.environ.get("B70_CACHE", Path.home() / ".cache" / "b70"))
    files = [*cache.glob("smollm2-gguf/*.gguf"), *cache.glob("smollm2-hf/*.safetensors")]
    if not files:
        pytest.skip("the demo models are not fetched (scripts/fetch-model)")
    for path in files:
        whole = modelfiles.check(path)
        assert whole.expected == whole.size and whole.tensors > 100, path


def test_offload_flag_forms() -> None:
    assert doctor.offload_gib(["--cpu-offload-gb", "4"]) == 4
    assert doctor.offload_gib(["--cpu-offload-gb=2.5"]) == 2.5
    assert doctor.offload_gib(["--x"]) == 0


def test_a_tree_of_sysfs_alone_reads_the_machines_own_files(host: Host, tmp_path: Path) -> None:
    """A fixture of the kernel's sysfs and /dev only (B70_SYSROOT): the kernel's version, the
    groups and memory are this machine's."""
    host.root = t.build(tmp_path / "sysfs-only", [t.Card("0000:03:00.0")], [])
    checks = host.checks()
    release = Path("/proc/sys/kernel/osrelease").read_text().strip()
    assert str(checks["kernel"][0]["detail"]).startswith(release)
    assert "cannot read MemTotal" not in json.dumps(checks)


# --- doctor inside install --------------------------------------------------------------------


class Installs:
    """`b70ctl install` on the host's fixture tree (B70_SYSROOT), as root on the system manager,
    with what comes after the checks and the fetches (writing the units) recorded, not done."""

    def __init__(self, host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
        from appliance.deploy import install as install_mod

        self.host, self.reached = host, []
        pulled = host.calls.parent / "pulled"

        def fake(config, scope, now, progress):  # type: ignore[no-untyped-def]
            self.reached.append(config)
            return install_mod.InstallResult(str(scope.value), [], [], False, [], [])

        monkeypatch.setattr(install_mod, "install", fake)
        from appliance.deploy import warm as warm_mod

        self.warmed: list[str] = []  # the scopes of the warm-ups that followed

        def fake_warm(config, scope, progress):  # type: ignore[no-untyped-def]
            self.warmed.append(scope.value)
            return warm_mod.Warmed()

        monkeypatch.setattr(warm_mod, "warm", fake_warm)
        # docker that has the image only once it was pulled (or always, without DOCKER_NO_IMAGE)
        executable(
            host.docker,
            f'#!/bin/sh\necho "$@" >> {host.calls}\n'
            'case "$1" in info) exit 0;;\n'
            f'  pull) [ -n "$PULL_FAILS" ] && {{ echo "manifest unknown" >&2; exit 1; }}\n'
            f'    echo "Downloading layer"; touch {pulled};;\n'
            f'  image) [ -n "$DOCKER_NO_IMAGE" ] && [ ! -e {pulled} ] && '
            '{ echo "No such image" >&2; exit 1; }\n'
            "    echo sha256:0123456789abcdef0123;; esac\n",
        )

    def run(self, *extra: str, user: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
        self.host.config_path.write_text(self.host.text)
        with self.host.monkeypatch.context() as m:
            m.setenv("PATH", f"{self.host.bin}:{os.environ['PATH']}")
            m.setenv("B70_SYSROOT", str(self.host.root))
            for key, value in env.items():
                m.setenv(key, value)
            argv = ["--config", str(self.host.config_path), "install", *extra]
            return _in_process(["--user"] * user + argv, m, self.host.capsys)


@pytest.fixture
def installs(host: Host, monkeypatch: pytest.MonkeyPatch) -> Installs:
    return Installs(host, monkeypatch)


def test_install_stops_on_a_failed_check_with_its_fix_before_anything(installs: Installs) -> None:
    installs.host.write("proc/meminfo", "MemTotal:       8388608 kB\n")
    out = installs.run(DOCKER_NO_IMAGE="1")
    assert out.returncode == 1, out
    assert "FAIL tp: host memory: " in out.stderr
    assert "fix: lower --cpu-offload-gb, or add memory" in out.stderr
    assert "error: doctor: 1 of 15 checks failed: tp: host memory; nothing was installed" in (
        out.stderr
    )
    assert "--no-doctor" in out.stderr and "Traceback" not in out.stderr
    assert installs.reached == []
    assert " pull " not in f" {installs.host.calls.read_text()}"  # nothing fetched either
    as_json = json.loads(installs.run("--json", DOCKER_NO_IMAGE="1").stdout)
    assert as_json["error"]["code"] == "doctor_failed"
    assert as_json["error"]["message"].startswith("doctor: 1 of 15 checks failed: tp: host memory")
    failed = {c["name"]: c["fetch"] for c in as_json["error"]["details"]["checks"] if not c["ok"]}
    assert failed == {"tp: host memory": None, "tp: image": "image"}  # the pull would mend one


def test_install_pulls_a_missing_image_then_checks_again(installs: Installs) -> None:
    out = installs.run(DOCKER_NO_IMAGE="1")
    assert out.returncode == 0, out
    assert "pulling ghcr.io/x/vllm:1 with docker" in out.stderr
    assert "Downloading layer" in out.stderr  # the engine's own progress, on stderr
    calls = installs.host.calls.read_text().splitlines()
    assert "pull ghcr.io/x/vllm:1" in calls
    pulled_at = calls.index("pull ghcr.io/x/vllm:1")
    assert any(c.startswith("image inspect") for c in calls[pulled_at + 1 :])  # checked again
    assert len(installs.reached) == 1


def test_install_with_no_pull_stops_at_the_missing_image(installs: Installs) -> None:
    out = installs.run("--no-pull", DOCKER_NO_IMAGE="1")
    assert out.returncode == 1
    assert "FAIL tp: image: ghcr.io/x/vllm:1 is not present" in out.stderr
    assert "docker pull ghcr.io/x/vllm:1" in out.stderr
    assert installs.reached == []


def test_a_pull_that_fails_is_named_and_nothing_is_installed(installs: Installs) -> None:
    out = installs.run(DOCKER_NO_IMAGE="1", PULL_FAILS="1")
    assert out.returncode == 1
    assert "error: docker pull ghcr.io/x/vllm:1 failed: manifest unknown" in out.stderr
    assert "Traceback" not in out.stderr and installs.reached == []


def test_no_doctor_installs_anyway_and_user_scope_skips_it(
    installs: Installs, tmp_path: Path
) -> None:
    installs.host.root = t.build(tmp_path / "empty", [], [])  # no B70 at all
    assert installs.run().returncode == 1
    out = installs.run("--no-doctor")
    assert out.returncode == 0, out
    assert len(installs.reached) == 1
    assert installs.run(user=True).returncode == 0  # a user manager's install (the demo)
    assert installs.run("--doctor", user=True).returncode == 1
    # the warm-up follows on the system manager, and on a user manager only when asked
    assert installs.warmed == ["system"]
    assert installs.run("--warm", user=True).returncode == 0
    assert installs.warmed == ["system", "user"]
