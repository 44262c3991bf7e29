"""Capacity eviction: unlinking the least recently used blocks until enough
bytes are free, oldest first across the whole volume.

The scan keeps no block names (``inventory.py``), so the directories that
hold a candidate -- a block last used at or before the cutoff ``pick_lru``
chose -- are listed again, and every candidate found is put in one order:
last use, then directory, then name. Ties (a burst of blocks stored in the
same second) are so broken the same way on every run, and how the blocks
are spread over directories changes nothing: no block goes while a strictly
older one stays. Each block is ``lstat``-ed once more right before its
``unlink``, so one loaded since (its access stamp moved) is spared.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import NamedTuple

from llmkv_fs.layout.blockfile import last_used
from llmkv_fs.ops import scan
from llmkv_fs.ops.gc.inventory import Inventory, allocated
from llmkv_fs.ops.problems import Problems
from llmkv_fs.volume.beneath import open_path_beneath

__all__ = ["evict"]


class _Candidate(NamedTuple):
    used: float  # last use when listed again: the order
    directory: str
    name: str
    dir_id: int
    ident: tuple[int, int]  # (st_dev, st_ino) of the file listed


def evict(
    inv: Inventory,
    cutoff: float,
    need: int,
    now: float,
    protect: float,
    emptied: set[int],
    problems: Problems,
    stop: Callable[[], bool],
) -> tuple[int, int]:
    """Unlink blocks last used at or before ``cutoff`` (and not within
    ``protect``), oldest first across every directory, until ``need``
    bytes are freed. (blocks, bytes)."""
    candidates = _list_candidates(inv, cutoff, now, protect, problems, stop)
    candidates.sort()
    removed = freed = 0
    with DirHandles() as dirs:
        for candidate in candidates:
            if freed >= need or stop():
                break
            size = _unlink_if_unused(inv, candidate, cutoff, now, protect, dirs, problems)
            if size is None:
                continue
            removed += 1
            freed += size
            inv.dir_entries[candidate.dir_id] -= 1
            emptied.add(candidate.dir_id)
    return removed, freed


def _candidate_dirs(inv: Inventory, cutoff: float) -> list[int]:
    import numpy as np  # only when capacity asks for something

    used = np.frombuffer(inv.lru_used, dtype=np.float64)
    dirs = np.frombuffer(inv.lru_dir, dtype=np.int64)
    return [int(d) for d in np.unique(dirs[used <= cutoff])]


def _list_candidates(
    inv: Inventory,
    cutoff: float,
    now: float,
    protect: float,
    problems: Problems,
    stop: Callable[[], bool],
) -> list[_Candidate]:
    """Every block in a directory that held a candidate at scan time that
    is still one now. A directory gone meanwhile (its digest removed by
    this pass) has none; one that cannot be read is reported."""
    found: list[_Candidate] = []
    for dir_id in _candidate_dirs(inv, cutoff):
        if stop():
            break
        directory = inv.dir_path[dir_id]
        assert directory is not None  # blocks come from listed directories
        try:
            fd = open_path_beneath(inv.top_of(dir_id), directory)
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.add(exc, directory, "list")
            continue
        try:
            found.extend(_blocks_in(fd, directory, dir_id, cutoff, now, protect, problems))
        finally:
            os.close(fd)
    return found


def _blocks_in(
    fd: int,
    directory: str,
    dir_id: int,
    cutoff: float,
    now: float,
    protect: float,
    problems: Problems,
) -> list[_Candidate]:
    try:
        with os.scandir(fd) as it:
            entries = list(it)
    except OSError as exc:
        problems.add(exc, directory, "list")
        return []
    found = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.add(exc, f"{directory}/{entry.name}", "stat")
            continue
        if scan.classify(entry.name, st, scan.RANK_AREA) != scan.BLOCK:
            continue
        when = last_used(st)
        if when <= cutoff and now - when >= protect:
            found.append(_Candidate(when, directory, entry.name, dir_id, (st.st_dev, st.st_ino)))
    return found


def _unlink_if_unused(
    inv: Inventory,
    candidate: _Candidate,
    cutoff: float,
    now: float,
    protect: float,
    dirs: DirHandles,
    problems: Problems,
) -> int | None:
    """Unlink the candidate if it is still the file listed and still unused
    since; the bytes that gave back, or None (spared, gone or failed)."""
    path = f"{candidate.directory}/{candidate.name}"
    op = "open"
    try:
        fd = dirs.get(inv.top_of(candidate.dir_id), candidate.directory)
        op = "lstat"
        st = os.stat(candidate.name, dir_fd=fd, follow_symlinks=False)
        when = last_used(st)
        if (
            (st.st_dev, st.st_ino) != candidate.ident
            or not stat.S_ISREG(st.st_mode)
            or when > cutoff
            or now - when < protect
        ):
            return None  # republished, or loaded since it was listed
        op = "unlink"
        os.unlink(candidate.name, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        problems.add(exc, path, op)
        return None
    return allocated(st)


class DirHandles:
    """The fd of the directory acted in last, kept open while the next
    action is in the same one (eviction in age order visits a directory's
    same-age blocks one after another). Not thread-safe; close() when done."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._fd = -1

    def get(self, top: str, path: str) -> int:
        if path != self._path:
            self.close()
            self._fd = open_path_beneath(top, path)
            self._path = path
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._path, self._fd = None, -1

    def __enter__(self) -> DirHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
