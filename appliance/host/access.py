"""Whether a runtime's own user can open a file: the permission bits of the file and of every
folder above it, judged as the kernel judges them for that user (owner, then group, then other).

`b70ctl doctor` runs as root, who may open anything; the runtime runs as its `user` with the
render group. A model of mode 0600 owned by root, or one under /root (mode 0700), is fine for
doctor and closed to the runtime. Access control lists are not read: a file that has one is
judged by its bits alone (the group bits then hold its mask).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Who:
    """A user as the kernel sees it: uid (None: not made yet, so it owns nothing) and groups."""

    name: str
    uid: int | None
    gids: frozenset[int]


def parse_who(name: str, passwd: str, group: str, extra_groups: tuple[str, ...] = ()) -> Who:
    """`name` from /etc/passwd and /etc/group text, with its primary and supplementary groups
    and `extra_groups` (the unit's SupplementaryGroups=)."""
    uid, gids = None, set()
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) >= 4 and fields[0] == name and fields[2].isdigit() and fields[3].isdigit():
            uid = int(fields[2])
            gids.add(int(fields[3]))
    for line in group.splitlines():
        fields = line.split(":")
        if len(fields) < 4 or not fields[2].isdigit():
            continue
        if fields[0] in extra_groups or name in fields[3].split(","):
            gids.add(int(fields[2]))
    return Who(name, uid, frozenset(gids))


def _allows(st: os.stat_result, who: Who, want: int) -> bool:
    """`want` of R_OK/W_OK/X_OK (as 4/2/1) in the class of bits the kernel picks for `who`."""
    if who.uid == 0:
        return True
    if who.uid is not None and st.st_uid == who.uid:
        bits = (st.st_mode >> 6) & 7
    elif st.st_gid in who.gids:
        bits = (st.st_mode >> 3) & 7
    else:
        bits = st.st_mode & 7
    return bits & want == want


def judge_open(path: Path, who: Who) -> str | None:
    """Why `who` cannot open `path` for reading, or None if it can. Each folder on the way needs
    search (x); the file itself read (r). Links are followed as open() follows them."""
    real = Path(os.path.realpath(path))
    folders = [*reversed(real.parents)]
    for folder in folders:
        try:
            st = os.stat(folder)
        except OSError as e:
            return f"{folder}: {e.strerror or e}"
        if not _allows(st, who, 1):
            return (
                f"{who.name} cannot enter {folder} (mode {stat.filemode(st.st_mode)}, {_owner(st)})"
            )
    try:
        st = os.stat(real)
    except OSError as e:
        return f"{real}: {e.strerror or e}"
    if not _allows(st, who, 4):
        return f"{who.name} cannot read {real} (mode {stat.filemode(st.st_mode)}, {_owner(st)})"
    return None


def _owner(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, group gid {st.st_gid}"
