"""What install last rendered, and from what: the stamp that lets a switch know the installed
units are what the config renders without rendering them, so that a switch does not import the
renderer and jinja2."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from pathlib import Path

from appliance.config import Config
from appliance.files import write_atomic
from appliance.host import placement
from appliance.layout import RENDERED, Layout

PACKAGE = Path(__file__).resolve().parent.parent  # appliance/


def _templates_dir() -> Path:
    installed = PACKAGE / "templates"  # a wheel maps the top-level templates/ here
    return installed if installed.is_dir() else PACKAGE.parent / "templates"


TEMPLATES = _templates_dir()
# The code that renders: the renderer, and the modules whose values it writes into the files.
RENDERING_CODE = (
    "units/render.py",
    "units/runtimes.py",
    "units/sandbox.py",
    "layout.py",
    "config/model.py",
    "host/placement.py",
)


def inputs_digest(config: Config, lay: Layout) -> str:
    """A digest of everything render_all makes the files from: the config, the layout (and the
    cache root it reads from the environment), the cards it places runtimes on, the templates
    and the code that renders them.
    render_all is a pure function of these, so equal digests render equal files."""
    h = hashlib.sha256()
    for part in (repr(config), repr(lay), str(lay.cache_root), repr(placement.placements(config))):
        h.update(part.encode() + b"\0")
    code = [PACKAGE / name for name in RENDERING_CODE]
    for path in [*sorted(TEMPLATES.glob("*.j2")), *code]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def file_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def stamp(config: Config, lay: Layout, files: Mapping[str, str]) -> None:
    """Install's note of what it rendered, and from what (the layout's RENDERED file)."""
    record = {
        "inputs": inputs_digest(config, lay),
        "files": {name: file_digest(text) for name, text in files.items()},
    }
    write_atomic(lay.state_dir / RENDERED, json.dumps(record, indent=1) + "\n")


def installed_as_rendered(config: Config, lay: Layout, names: Collection[str]) -> bool:
    """Whether the installed files `names` are what `config` renders, known without rendering:
    the last install rendered from the same inputs, and the files are still what it wrote.
    False says only "not known this way": render and compare."""
    try:
        record = json.loads((lay.state_dir / RENDERED).read_text())
        if record["inputs"] != inputs_digest(config, lay):
            return False
        for name in names:
            if file_digest(lay.destination(name).read_text()) != record["files"][name]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True
