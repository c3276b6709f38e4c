"""`b70ctl doctor`: a first-run check of a B70 host, one line per check, each failure with its fix.

Everything is read under a root (B70_SYSROOT in tests: fixture trees in the kernel's formats);
programs (ldd, the container engine) are asked through appliance.run and may be absent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance import GIB, run
from appliance.config import Config, Engine, Launcher, RuntimeConfig
from appliance.errors import ApplianceError, ConfigError
from appliance.host import access, modelfiles, placement
from appliance.host.gpu import xe
from appliance.host.gpu.sysfs import Device, read_devices, read_text

# Owners running four B70s report multi-card collectives broken on kernels before 7.1.
COLLECTIVES_KERNEL = (7, 1)
# Host memory vLLM, the proxy and the system need besides the weights offloaded to the CPU.
ENGINE_HOST_GIB = 8
# vLLM on XPU with tensor parallelism holds host memory as large as its cards' VRAM
# (vllm-project/vllm#53822); two B70s at TP 2 had the host OOM-killed with 64 GB
# (intel/llm-scaler#672).
CARD_HOST_GIB = 32
# Intel's compute runtime that vLLM's maintainers recommend for the B70 (vllm-project/vllm#49482),
# and that owners run tensor parallel on two B70s with (vllm-project/vllm#41663): older ones read
# free memory as 0 and lose the device.
COMPUTE_RUNTIME = (26, 18)
COMPUTE_PACKAGES = ("libze-intel-gpu1", "intel-level-zero-gpu", "intel-opencl-icd")
Ask = Callable[[Sequence[str]], run.Completed | None]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None
    fetch: str | None = None  # what `install` fetches to mend it: "image" or "model"


def ask(argv: Sequence[str]) -> run.Completed | None:
    return run.ask(argv, 30)


def doctor(config: Config, root: Path, ask: Ask = ask) -> list[Check]:
    checks = list(_cards(config, root))
    for rt in sorted(config.runtimes.values(), key=lambda r: r.name):
        checks += _runtime(config, rt, root, ask)
    checks += _host_memory(config, root)
    return checks


def require(checks: list[Check]) -> None:
    failed = [c for c in checks if not c.ok]
    if failed:
        raise ApplianceError(
            f"{len(failed)} of {len(checks)} checks failed: "
            + ", ".join(dict.fromkeys(c.name for c in failed)),
            hint="each FAIL line says how to fix it; run `b70ctl doctor` again after",
            code="doctor_failed",
            details={"checks": [vars(c) for c in checks]},
        )


# --- the cards ---------------------------------------------------------------------------------


def _cards(config: Config, root: Path) -> Iterator[Check]:
    devices = read_devices(root)
    try:
        cards = placement.card_list(config, devices)
    except ConfigError as e:
        yield Check("cards", False, e.message, e.hint)
        return
    if not cards:
        intel = [d for d in devices if d.is_b70]
        why = "a B70 that no GPU driver took" if intel else "no B70 in sysfs"
        yield Check(
            "cards",
            False,
            f"{why} ({len(devices)} DRM card(s) in all)",
            "check `lspci -nn | grep -i 8086:e22`; load the xe driver (`modprobe xe`)",
        )
        return
    yield Check("cards", True, ", ".join(f"card {c.index} {c.pci}" for c in cards))
    by_slot = {d.pci_slot: d for d in devices}
    for c in cards:
        yield _driver(by_slot[c.pci])
    yield _kernel(config, root)
    yield _render_group(config, root)
    yield _by_path(cards, root)
    yield _perfmon(root)
    runtime = _compute_runtime(config, root)
    if runtime is not None:
        yield runtime


def _driver(d: Device) -> Check:
    if d.driver == "xe":
        return Check("xe driver", True, f"{d.pci_slot}: bound to xe")
    return Check(
        "xe driver",
        False,
        f"{d.pci_slot}: bound to {d.driver or 'no driver'}, not xe",
        "the B70 needs the xe driver: a kernel whose xe knows 8086:e223, then `modprobe xe`",
    )


def host_text(root: Path, rel: str) -> str | None:
    """A host file read under the root; where a fixture tree (B70_SYSROOT) holds only the
    kernel's sysfs and /dev, the machine's own file."""
    text = read_text(root / rel)
    if text is None and not (root / rel).exists() and root != Path("/"):
        text = read_text(Path("/") / rel)
    return text


def kernel_version(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _kernel(config: Config, root: Path) -> Check:
    release = (host_text(root, "proc/sys/kernel/osrelease") or "").strip()
    version = kernel_version(release)
    multi = sorted(n for n, rt in config.runtimes.items() if len(rt.card_indices) > 1)
    if version is None:
        return Check("kernel", False, f"cannot read its version ({release!r})", "check /proc")
    if multi and version < COLLECTIVES_KERNEL:
        want = ".".join(map(str, COLLECTIVES_KERNEL))
        return Check(
            "kernel",
            False,
            f"{release}: {', '.join(multi)} run on several cards, and owners report multi-card "
            f"collectives broken on kernels before {want}",
            f"boot a {want} or later kernel",
        )
    use = "several cards in " + ", ".join(multi) if multi else "no runtime on several cards"
    return Check("kernel", True, f"{release} ({use})")


def dpkg_versions(text: str) -> dict[str, str]:
    """Installed packages and their versions, from dpkg's status file."""
    out = {}
    for stanza in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " "
        )
        if "Package" in fields and "Version" in fields and "installed" in fields.get("Status", ""):
            out[fields["Package"]] = fields["Version"]
    return out


def _compute_runtime(config: Config, root: Path) -> Check | None:
    """The host's compute runtime, which a native runtime uses (an image carries its own)."""
    if not any(rt.launcher is Launcher.NATIVE for rt in config.runtimes.values()):
        return None
    installed = dpkg_versions(host_text(root, "var/lib/dpkg/status") or "")
    found = next(((p, installed[p]) for p in COMPUTE_PACKAGES if p in installed), None)
    if found is None:
        return None
    package, version = found
    parsed = kernel_version(version)
    want = ".".join(map(str, COMPUTE_RUNTIME))
    if parsed is None or parsed >= COMPUTE_RUNTIME:
        return Check("compute runtime", True, f"{package} {version}")
    return Check(
        "compute runtime",
        False,
        f"{package} {version} is older than {want}: B70 owners saw free memory read as 0 and "
        "the device lost on older ones",
        f"install Intel's compute runtime {want} or later (vLLM's maintainers recommend it)",
    )


def _render_group(config: Config, root: Path) -> Check:
    groups = host_text(root, "etc/group") or ""
    line = next((g for g in groups.splitlines() if g.startswith("render:")), None)
    if line is None:
        return Check(
            "render group",
            False,
            "there is no render group: runtimes that are not root cannot open the render nodes",
            "udev's default rules create it (`systemd-sysusers` / `groupadd --system render`)",
        )
    members = [m for m in line.split(":")[3].split(",") if m] if line.count(":") >= 3 else []
    users = sorted({rt.user for rt in config.runtimes.values() if rt.user})
    passwd = host_text(root, "etc/passwd") or ""
    existing = {p.split(":", 1)[0] for p in passwd.splitlines()}
    outside = [u for u in users if u in existing and u not in members]
    if outside:
        return Check(
            "render group",
            False,
            f"{', '.join(outside)} exist(s) but not in the render group",
            f"`usermod -aG render {outside[0]}`, or `b70ctl install`, whose sysusers adds it",
        )
    return Check("render group", True, f"members: {', '.join(members) or 'none'}")


def _by_path(cards: Sequence[placement.Card], root: Path) -> Check:
    folder = root / "dev/dri/by-path"
    missing = [c.pci for c in cards if not os.path.lexists(folder / f"pci-{c.pci}-render")]
    if missing:
        return Check(
            "/dev/dri/by-path",
            False,
            f"no render link for {', '.join(missing)}: Intel's compute runtime and oneCCL find "
            "cards there",
            "udev makes these links (`udevadm trigger --subsystem-match=drm`)",
        )
    return Check("/dev/dri/by-path", True, f"a render link for each of {len(cards)} card(s)")


def _perfmon(root: Path) -> Check:
    if xe.has_perfmon(host_text(root, "proc/self/status") or ""):
        return Check("CAP_PERFMON", True, "b70ctl reads used VRAM from the xe driver")
    return Check(
        "CAP_PERFMON",
        False,
        "without it the xe driver reports used VRAM as 0, so the GPU-memory guard cannot see it",
        "run b70ctl as root, or give it CAP_PERFMON (runtimes with `user` get it in their unit)",
    )


# --- each runtime ------------------------------------------------------------------------------


def _runtime(config: Config, rt: RuntimeConfig, root: Path, ask: Ask) -> list[Check]:
    checks = []
    if rt.launcher is Launcher.NATIVE:
        if rt.engine is Engine.LLAMACPP:
            checks.append(_libraries(rt, ask))
    else:
        checks += _container(config, rt, ask)
    checks += _models(rt, config.models_dir)
    if rt.user and rt.launcher is Launcher.NATIVE:
        checks.append(_as_user(rt, root))
    return checks


def _as_user(rt: RuntimeConfig, root: Path) -> Check:
    """The runtime's files opened as its own user (system scope: `user`, with the render group),
    not as root, who runs doctor and may open anything."""
    name = f"{rt.name}: as {rt.user}"
    who = access.parse_who(
        rt.user or "",
        host_text(root, "etc/passwd") or "",
        host_text(root, "etc/group") or "",
        ("render",),
    )
    files = model_files(rt)
    paths = [Path(rt.command[0]), *([] if isinstance(files, str) else files)]
    closed = [why for p in paths if (why := access.judge_open(p, who)) is not None]
    if closed:
        return Check(
            name,
            False,
            "; ".join(closed),
            f"make them readable by {rt.user} (`chmod o+r FILE`, `chmod o+x` on each folder, "
            "or `chgrp`), or keep models in /srv/b70/models",
        )
    made = "" if who.uid is not None else f" ({rt.user} does not exist yet: install makes it)"
    return Check(
        name, True, f"{rt.user} can open the binary and {len(paths) - 1} model file(s){made}"
    )


def _libraries(rt: RuntimeConfig, ask: Ask) -> Check:
    name = f"{rt.name}: libraries"
    exe = rt.command[0]
    if not os.access(exe, os.X_OK):
        return Check(name, False, f"{exe} is not an executable file", "fix runtimes.command")
    # The resolved path: the loader finds $ORIGIN libraries beside the real file, as at exec.
    out = ask(["ldd", os.path.realpath(exe)])
    if out is None:
        return Check(name, False, "ldd could not run", "install libc-bin")
    missing = [line.split()[0] for line in out.stdout.splitlines() if "not found" in line]
    if missing:
        return Check(
            name,
            False,
            f"{exe} needs {', '.join(missing)}, which do not resolve",
            "a SYCL build needs the oneAPI runtime: install intel-oneapi-runtime-libs, or set "
            "LD_LIBRARY_PATH in runtimes.NAME.env",
        )
    return Check(name, True, f"every shared library of {exe} resolves")


def _container(config: Config, rt: RuntimeConfig, ask: Ask) -> list[Check]:
    engine = config.docker if rt.launcher is Launcher.DOCKER else config.podman
    name = f"{rt.name}: {rt.launcher}"
    if not os.access(engine, os.X_OK):
        return [
            Check(
                name,
                False,
                f"{engine} is not installed",
                f"install {rt.launcher}, or set "
                f'{rt.launcher} = "/path/to/{rt.launcher}" at the top of the config',
            )
        ]
    info = ask([engine, "info", "--format", "{{json .}}"])
    if info is None or info.returncode != 0:
        detail = (info.stderr.strip().splitlines() or ["no answer"])[-1] if info else "no answer"
        return [
            Check(
                name,
                False,
                f"{engine} info: {detail}",
                f"start it (`systemctl start {rt.launcher}`) and check who may use it",
            )
        ]
    checks = [Check(name, True, f"{engine} answers")]
    image = ask([engine, "image", "inspect", "--format", "{{.Id}}", rt.image or ""])
    if image is None or image.returncode != 0:
        checks.append(
            Check(
                f"{rt.name}: image",
                False,
                f"{rt.image} is not present",
                f"`{rt.launcher} pull {rt.image}` (`b70ctl install` pulls it)",
                fetch="image",
            )
        )
    else:
        checks.append(Check(f"{rt.name}: image", True, f"{rt.image} {image.stdout.strip()[:19]}"))
    return checks


def model_files(rt: RuntimeConfig) -> list[Path] | str:
    """The files a runtime's model is made of, or why they cannot be found."""
    paths = [Path(rt.model)] + ([Path(rt.mmproj)] if rt.mmproj else [])
    if rt.engine is Engine.LLAMACPP or rt.model.endswith(".gguf"):
        return paths
    local = Path(rt.model)
    if not local.is_absolute():
        hub = hf_hub(rt)
        if hub is None:
            return f"{rt.model} is a Hugging Face id and no cache folder is known for it"
        local = hub / ("models--" + rt.model.replace("/", "--")) / "snapshots"
        snapshots = sorted(local.glob("*")) if local.is_dir() else []
        if not snapshots:
            return f"{rt.model} is not in the Hugging Face cache {hub}"
        local = snapshots[-1]
    if not (local / "config.json").is_file():
        return f"{local} holds no config.json"
    return sorted(local.glob("*.safetensors")) or f"{local} holds no .safetensors file"


def hf_hub(rt: RuntimeConfig) -> Path | None:
    """Where the runtime's Hugging Face cache is on the host: a container's volume mounted on
    the image's cache, or the native runtime's HF_HUB_CACHE / HF_HOME / ~/.cache/huggingface."""
    if rt.launcher is not Launcher.NATIVE:
        for volume in rt.volumes:
            host, _, inside = volume.partition(":")
            if inside.split(":")[0].rstrip("/").endswith("/.cache/huggingface"):
                return Path(host) / "hub"
        return None
    if "HF_HUB_CACHE" in rt.env:
        return Path(rt.env["HF_HUB_CACHE"])
    home = rt.env.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface")
    return Path(home) / "hub"


def _models(rt: RuntimeConfig, models_dir: str) -> list[Check]:
    name = f"{rt.name}: model"
    if rt.hub is not None and not rt.hub.is_pulled(models_dir):
        return [Check(name, False, f"{rt.hub} is not pulled yet",
                      f"sudo b70ctl models pull {rt.name}",
                      fetch="model")]  # fmt: skip
    files = model_files(rt)
    if isinstance(files, str):
        return [Check(name, False, files, "download the model there, or fix runtimes.NAME.model")]
    checks = []
    for path in files:
        try:
            whole = modelfiles.check(path)
        except FileNotFoundError:
            checks.append(Check(name, False, f"{path} does not exist", "download it there"))
            continue
        except (OSError, modelfiles.BadModel) as e:
            checks.append(Check(name, False, f"{path}: {e}", "download it again"))
            continue
        if whole.expected is not None and whole.size < whole.expected:
            checks.append(
                Check(
                    name,
                    False,
                    f"{path}: {whole.size} of the {whole.expected} bytes its header promises: "
                    "cut short",
                    "download it again (the download stopped early)",
                )
            )
        else:
            checks.append(Check(name, True, f"{path}: {whole.tensors} tensors, {whole.size} bytes"))
    return checks


# --- the host ----------------------------------------------------------------------------------


def offload_gib(args: Sequence[str]) -> float:
    """vLLM's --cpu-offload-gb in a runtime's args; 0 without it."""
    for i, arg in enumerate(args):
        value = None
        if arg == "--cpu-offload-gb" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--cpu-offload-gb="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return float(value)
            except ValueError:
                return 0.0
    return 0.0


def _host_memory(config: Config, root: Path) -> list[Check]:
    """Host memory for each vLLM runtime: what it offloads, its cards' VRAM when it is tensor
    parallel, and the engine and the system."""
    wants = {}
    for name, rt in sorted(config.runtimes.items()):
        cards = len(rt.card_indices)
        parts = []
        if rt.engine is Engine.VLLM and offload_gib(rt.args) > 0:
            parts.append((offload_gib(rt.args), f"--cpu-offload-gb {offload_gib(rt.args):g}"))
        if rt.engine is Engine.VLLM and cards > 1:
            parts.append((CARD_HOST_GIB * cards, f"{CARD_HOST_GIB * cards} GiB as large as its "
                          f"{cards} cards' VRAM (vLLM's tensor parallelism on XPU)"))  # fmt: skip
        if parts:
            wants[name] = parts
    if not wants:
        return []
    meminfo = host_text(root, "proc/meminfo") or ""
    match = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M)
    if not match:
        return [Check("host memory", False, "cannot read MemTotal from /proc/meminfo", None)]
    total = int(match.group(1)) * 1024 / GIB
    out = []
    for name, parts in wants.items():
        need = sum(gib for gib, _ in parts) + ENGINE_HOST_GIB
        ok = total >= need
        what = " plus ".join(label for _, label in parts)
        out.append(
            Check(
                f"{name}: host memory",
                ok,
                f"{total:.1f} GiB in all for {what} plus {ENGINE_HOST_GIB} GiB "
                f"for the engine and the system ({need:g} GiB)",
                None if ok else "lower --cpu-offload-gb, or add memory",
            )
        )
    return out
