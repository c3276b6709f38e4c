"""Models named by their place on the Hugging Face hub (`model = "hf:..."`), and where a pulled one
lies in the models folder (`[models] dir`).

    hf:OWNER/REPO               the whole repository (a vLLM model: config, tokenizer, weights)
    hf:OWNER/REPO:QUANT         the repository's GGUF files whose names hold QUANT (Q4_K_M, say)
                                as a whole, not inside IQ4_K_M; every part of a split one
    hf:OWNER/REPO/PATH.gguf     one GGUF file of it (with its other parts, if it is split)
    ...@REVISION                a branch, tag or commit instead of main

A pulled model lies at DIR/OWNER/REPO/, its files at their paths in the repository, with a record
of what was pulled (PULLED) beside them: the files of each model pulled there (two quantizations
of one repository share its folder). `b70ctl models pull` fetches them (appliance.host.hub).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from appliance.files import write_atomic

PREFIX = "hf:"
PULLED = ".b70-pulled.json"  # in the model's folder: the files pulled, their sizes and hashes
DEFAULT_DIR = "/srv/b70/models"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_SPEC = re.compile(
    rf"(?P<owner>{_NAME})/(?P<repo>{_NAME})"
    r"(?:(?P<file>(?:/[A-Za-z0-9._+-]+)+\.gguf)|:(?P<quant>[A-Za-z0-9._-]{1,40}))?"
    r"(?:@(?P<revision>[A-Za-z0-9._/-]{1,100}))?"
)
PROJECTOR_HINT = (
    f'write mmproj = "{PREFIX}OWNER/REPO/FILE.gguf" with the model\'s OWNER/REPO, or a path to it'
)
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class HubModel:
    owner: str
    repo: str
    file: str | None = None  # one GGUF file's path in the repository
    quant: str | None = None  # GGUF files whose names hold this
    revision: str = "main"
    # Files of the repository pulled with it (llama.cpp's vision projector, `mmproj = "hf:..."`)
    extra: tuple[str, ...] = ()

    @property
    def repo_id(self) -> str:
        return f"{self.owner}/{self.repo}"

    def __str__(self) -> str:
        tail = f"/{self.file}" if self.file else f":{self.quant}" if self.quant else ""
        at = f"@{self.revision}" if self.revision != "main" else ""
        return f"{PREFIX}{self.repo_id}{tail}{at}"

    def wants(self, path: str) -> bool:
        """Whether a file of the repository is pulled with this model."""
        return path in self.extra or self._weights(path)

    def _weights(self, path: str) -> bool:
        if self.file is not None:
            return path == self.file or _same_split(path, self.file)
        if self.quant is not None:
            name = path.rsplit("/", 1)[-1].lower()
            gguf = path.lower().endswith(".gguf") and "mmproj" not in name
            return gguf and _holds(path, self.quant)
        return True

    def folder(self, models_dir: str | Path) -> Path:
        return Path(models_dir) / self.owner / self.repo

    def is_pulled(self, models_dir: str | Path) -> bool:
        files = pulled_files(self.folder(models_dir), self)
        return bool(files) and all(path in files for path in self.extra)

    def local_path(self, models_dir: str | Path) -> Path:
        """What the runtime is given: the folder (a whole repository), or its GGUF file (the
        first part of a split one; llama.cpp finds the others beside it)."""
        folder = self.folder(models_dir)
        if self.file is not None:
            return folder / _first_part(self.file)
        if self.quant is not None:
            mine = pulled_files(folder, self)
            firsts = sorted(p for p in mine if self._weights(p) and _first_part(p) == p)
            return folder / (firsts[0] if firsts else f"{self.quant}.gguf")
        return folder


def _holds(path: str, quant: str) -> bool:
    """Whether a file's path names the quantization as a whole: Q4_K_M in `m-Q4_K_M.gguf` or
    `Q4_K_M/m-00001-of-00002.gguf`, in any case, but not in `m-IQ4_K_M.gguf`, and Q4_K not in
    `m-Q4_K_M.gguf`."""
    pattern = rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])"
    return re.search(pattern, path, re.IGNORECASE) is not None


def amount(n: int) -> str:
    """A size as a person reads it: GiB, or MiB below one."""
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


def parse(text: str) -> HubModel | str:
    """The model a `hf:` value names, or what is wrong with it."""
    body = text[len(PREFIX) :] if text.startswith(PREFIX) else text
    found = _SPEC.fullmatch(body)
    if found is None:
        return (
            f"{text!r} is not a hub model: write hf:OWNER/REPO, hf:OWNER/REPO:QUANT or "
            "hf:OWNER/REPO/FILE.gguf (each may end @REVISION)"
        )
    file = found["file"]
    if file and any(part in ("", ".", "..") for part in file[1:].split("/")):
        return f"{text!r}: its file path may not hold '.', '..' or an empty part"
    return HubModel(
        found["owner"], found["repo"], file[1:] if file else None, found["quant"],
        found["revision"] or "main",
    )  # fmt: skip


def with_projector(
    model: HubModel | None, value: str, models_dir: str
) -> tuple[HubModel, str] | str:
    """`mmproj = "hf:OWNER/REPO/FILE.gguf"`: a file of the model's own repository, pulled with it.
    The model with it and the projector's path, or what is wrong."""
    found = parse(value)
    if isinstance(found, str):
        return found
    if (
        found.file is None
        or model is None
        or (model.repo_id, model.revision) != (found.repo_id, found.revision)
    ):
        return f"{value} must name one .gguf file of the model's own hub repository"
    model = dataclasses.replace(model, extra=(*model.extra, found.file))
    return model, str(model.folder(models_dir) / found.file)


def pulled(folder: Path) -> dict[str, list[dict[str, object]]]:
    """The record of what pulls left in `folder` (one repository's): the files of each model
    pulled there, by its name (hf:...). Nothing: never pulled, or the record unreadable."""
    try:
        models = json.loads((folder / PULLED).read_text())["models"]
        return {
            str(name): [f for f in files if isinstance(f, dict) and "path" in f]
            for name, files in models.items()
            if isinstance(files, list)
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write_pulled(folder: Path, models: dict[str, list[dict[str, object]]]) -> None:
    """The record (`pulled`'s) written whole, atomically; none left when no model is."""
    if models:
        write_atomic(folder / PULLED, json.dumps({"models": models}, indent=1) + "\n")
    else:
        (folder / PULLED).unlink(missing_ok=True)


def pulled_files(folder: Path, model: HubModel | None = None) -> dict[str, dict[str, object]]:
    """The files pulled into `folder` for `model` (for any model, when None), by path."""
    record = pulled(folder)
    lists = [record.get(str(model), [])] if model is not None else list(record.values())
    return {str(f["path"]): f for files in lists for f in files}


def _same_split(path: str, file: str) -> bool:
    one, other = SPLIT.search(path), SPLIT.search(file)
    if one is None or other is None:
        return False
    return path[: one.start()] == file[: other.start()] and one.group(2) == other.group(2)


def _first_part(file: str) -> str:
    found = SPLIT.search(file)
    if found is None:
        return file
    return f"{file[: found.start()]}-00001-of-{found.group(2)}.gguf"
