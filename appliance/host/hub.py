"""Pulling a model from the Hugging Face hub into the models folder (`b70ctl models pull`).

What the hub says (its HTTP API, as huggingface_hub uses it):
- `GET {endpoint}/api/models/OWNER/REPO/tree/REVISION?recursive=true`: the repository's files,
  each with its `path`, `size`, git blob id (`oid`) and, when stored with Git LFS, `lfs.oid`, the
  SHA-256 of its content; a long listing goes on at the URL of its `Link: <...>; rel="next"`.
- `GET {endpoint}/OWNER/REPO/resolve/REVISION/PATH`: a file's bytes, often by a redirect to a
  CDN, from an offset with `Range: bytes=N-`.
The endpoint is HF_ENDPOINT (huggingface_hub's variable; default https://huggingface.co), and a
gated or private model needs HF_TOKEN, sent to the endpoint only.

A pull checks the free space before it starts, writes each file as PATH.part and goes on from
there after a cut, checks each file against the hub's hash (SHA-256 for LFS files, the git blob
id for the others) before it takes its name, and ends with the record of what it pulled
(appliance.config.hub.PULLED), written atomically. A file whose hash does not match is deleted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from appliance.config.hub import HubModel, amount, pulled, pulled_files, write_pulled
from appliance.errors import ApplianceError

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1024 * 1024
TIMEOUT_S = 30.0
GIB = 1024**3

Progress = Callable[[str, int, int], None]  # (file, bytes done, bytes in all) of the pull


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str | None  # an LFS file's
    git_oid: str | None  # any file's git blob id (SHA-1 of "blob SIZE\0" and its bytes)

    def record(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "oid": self.git_oid}


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def client(timeout_s: float = TIMEOUT_S) -> httpx.Client:
    """A client for the hub: its token sent to the endpoint alone (httpx leaves it off a
    redirect to another host)."""
    token = os.environ.get("HF_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(headers=headers, follow_redirects=True, timeout=timeout_s)


def _refused(model: HubModel, response: httpx.Response, what: str) -> ApplianceError:
    if response.status_code in (401, 403):
        return ApplianceError(
            f"the hub refused {what} of {model.repo_id} ({response.status_code}): the model is "
            "gated or private", hint="accept its terms on the hub, then set HF_TOKEN to a token "
            "of yours and pull again", code="hub_refused",
        )  # fmt: skip
    if response.status_code == 404:
        return ApplianceError(
            f"the hub has no {model.repo_id} at revision {model.revision}",
            hint="check runtimes.NAME.model (hf:OWNER/REPO, spelled as on the hub)",
            code="hub_not_found",
        )
    return ApplianceError(
        f"the hub answered {response.status_code} to {what} of {model.repo_id}",
        hint="try again later", code="hub_error",
    )  # fmt: skip


def _unreachable(e: httpx.HTTPError) -> ApplianceError:
    return ApplianceError(
        f"cannot reach the hub at {endpoint()}: {e}",
        hint="check this machine's network, or set HF_ENDPOINT to a mirror",
        code="hub_unreachable",
    )


def listing(model: HubModel, http: httpx.Client) -> list[HubFile]:
    """The model's files on the hub (those `model` wants)."""
    quoted = urllib.parse.quote(model.revision, safe="")
    url: str | None = f"{endpoint()}/api/models/{model.repo_id}/tree/{quoted}?recursive=true"
    found: list[HubFile] = []
    try:
        while url:
            response = http.get(url)
            if response.status_code != 200:
                raise _refused(model, response, "the listing")
            for entry in response.json():
                if entry.get("type") != "file":
                    continue
                lfs = entry.get("lfs") or {}
                found.append(
                    HubFile(
                        str(entry["path"]), int(entry["size"]), lfs.get("oid"), entry.get("oid")
                    )
                )
            url = response.links.get("next", {}).get("url")
    except httpx.HTTPError as e:
        raise _unreachable(e) from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ApplianceError(
            f"the hub's listing of {model.repo_id} is not what it should be: {e}",
            hint="check HF_ENDPOINT", code="hub_error",
        ) from None  # fmt: skip
    wanted = [f for f in found if model.wants(f.path) and _safe(f.path)]
    absent = [path for path in model.extra if path not in {f.path for f in found}]
    if absent or not wanted:
        ggufs = sorted(f.path for f in found if f.path.endswith(".gguf"))[:8]
        raise ApplianceError(
            f"{model.repo_id} has no file {absent[0]} (the runtime's mmproj)"
            if absent
            else f"no file of {model.repo_id} matches {model}",
            hint=("its GGUF files: " + ", ".join(ggufs)) if ggufs else "check the name on the hub",
            code="hub_no_match",
        )
    return wanted


def _safe(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _whole(file: HubFile, folder: Path, pulled: dict[str, dict[str, object]]) -> bool:
    """Pulled already: on disk at its size, with the hash the hub gives it now."""
    record = pulled.get(file.path)
    if record is None or record.get("sha256") != file.sha256 or record.get("oid") != file.git_oid:
        return False
    try:
        return (folder / file.path).stat().st_size == file.size
    except OSError:
        return False


@dataclass(frozen=True)
class Plan:
    model: HubModel
    folder: Path
    files: list[HubFile]  # every file of the model
    missing: list[HubFile]  # those to fetch
    to_fetch_bytes: int  # what is still to come over the network (partial files counted)

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)


def plan(model: HubModel, models_dir: str, http: httpx.Client) -> Plan:
    folder = model.folder(models_dir)
    files = listing(model, http)
    pulled = pulled_files(folder)
    missing = [f for f in files if not _whole(f, folder, pulled)]
    to_fetch = sum(f.size - _part_size(folder, f) for f in missing)
    return Plan(model, folder, files, missing, to_fetch)


def _part_size(folder: Path, file: HubFile) -> int:
    try:
        held = (folder / (file.path + ".part")).stat().st_size
    except OSError:
        return 0
    return held if held <= file.size else 0


def free_bytes(folder: Path) -> int:
    """Free space where `folder` is or will be (its nearest existing parent)."""
    here = folder
    while not here.exists() and here != here.parent:
        here = here.parent
    return shutil.disk_usage(here).free


def pull(the_plan: Plan, http: httpx.Client, progress: Progress | None = None) -> Plan:
    """Fetch what the plan misses; the record of the whole model written at the end."""
    folder = the_plan.folder
    free = free_bytes(folder)
    if the_plan.to_fetch_bytes > free:
        raise ApplianceError(
            f"{the_plan.model} needs {amount(the_plan.to_fetch_bytes)} more, and {folder} has "
            f"{amount(free)} free",
            hint="free some space there, or set [models] dir to a disk with room",
            code="disk_full",
        )
    done, total = 0, the_plan.to_fetch_bytes
    for file in the_plan.missing:
        for part in _fetch(the_plan.model, file, folder, http):
            done += part
            if progress is not None:
                progress(file.path, done, total)
    write_pulled(
        folder, {**pulled(folder), str(the_plan.model): [f.record() for f in the_plan.files]}
    )
    return Plan(the_plan.model, folder, the_plan.files, [], 0)


def _fetch(model: HubModel, file: HubFile, folder: Path, http: httpx.Client) -> Iterator[int]:
    """One file into its PATH.part, from where the last pull stopped; yields bytes as they
    come."""
    target = folder / file.path
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    held = _part_size(folder, file)
    digest = _fresh(file)
    if held:
        with part.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
    else:
        part.write_bytes(b"")
    url = f"{endpoint()}/{model.repo_id}/resolve/{urllib.parse.quote(model.revision, safe='')}/"
    url += urllib.parse.quote(file.path)
    headers = {"Range": f"bytes={held}-"} if held else {}
    got = held
    try:
        if held < file.size:
            with http.stream("GET", url, headers=headers) as response:
                if response.status_code not in (200, 206):
                    raise _refused(model, response, f"the file {file.path}")
                if held and response.status_code == 200:  # no range: from the start again
                    got, digest = 0, _fresh(file)
                    part.write_bytes(b"")
                with part.open("ab") as out:
                    for chunk in response.iter_bytes():  # as they come: a cut keeps them
                        out.write(chunk)
                        digest.update(chunk)
                        got += len(chunk)
                        yield len(chunk)
    except httpx.HTTPError as e:
        raise ApplianceError(
            f"the download of {file.path} stopped at {got} of {file.size} bytes: {e}",
            hint="run `b70ctl models pull` again: it goes on from there", code="hub_cut",
        ) from None  # fmt: skip
    if got != file.size:
        raise ApplianceError(
            f"the download of {file.path} stopped at {got} of {file.size} bytes",
            hint="run `b70ctl models pull` again: it goes on from there", code="hub_cut",
        )  # fmt: skip
    want = file.sha256 or file.git_oid
    if want is not None and digest.hexdigest() != want:
        part.unlink(missing_ok=True)
        raise ApplianceError(
            f"{file.path} does not match the hub's hash ({digest.hexdigest()} against {want}): "
            "it was deleted", hint="run `b70ctl models pull` again", code="hub_hash",
        )  # fmt: skip
    os.replace(part, target)


def _fresh(file: HubFile) -> Any:
    """The hash the hub gives the file, begun: SHA-256, or git's blob id (SHA-1 of a header and
    the bytes)."""
    digest = hashlib.sha256() if file.sha256 else hashlib.sha1()
    if not file.sha256:
        digest.update(b"blob %d\0" % file.size)
    return digest
