"""Writing files so that a reader sees the old file or the new one, never half of it."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.hold import create_beside


def write_atomic(path: Path, text: str, mode: int = 0o644, owner: int | None = None) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never half.
    `owner`: the uid the file belongs to (else the writer's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_beside(path)
    try:
        os.fchmod(fd, mode)
        if owner is not None:
            os.fchown(fd, owner, -1)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None:  # a failed write names no file: name the one being written
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
