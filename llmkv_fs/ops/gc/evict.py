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

With KV events on (``announce``), blocks go in batches: each batch is
re-checked, its removals are published, then it is unlinked -- a router
learns of a block before it is gone, so one that still routes there meets a
miss, never a half-deleted file. A block spared after all (its unlink
failed: EPERM, EACCES, EIO, ...: still there) is announced stored again;
one already gone at its unlink (ENOENT: another gc or a person removed it
after the announcement) is not: its removal announcement stands.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from llmkv_fs.layout.blockfile import last_used
from llmkv_fs.layout.names import parse_block_path
from llmkv_fs.ops import kinds
from llmkv_fs.ops.gc.inventory import Inventory, allocated
from llmkv_fs.ops.problems import Problems
from llmkv_fs.volume.beneath import open_path_beneath

if TYPE_CHECKING:
    from llmkv_fs.ops.events.announcer import Announcer

__all__ = ["evict"]


class _Candidate(NamedTuple):
    used: float  # last use when listed again: the order
    directory: str
    name: str
    dir_id: int
    ident: tuple[int, int]  # (st_dev, st_ino) of the file listed


_BATCH_DIRS = 128
# What an unlink did (``_Check.unlink``).
_REMOVED, _GONE, _FAILED = "removed", "gone", "failed"


def evict(
    inv: Inventory,
    cutoff: float,
    need: int,
    now: float,
    protect: float,
    emptied: set[int],
    problems: Problems,
    stop: Callable[[], bool],
    announce: Announcer | None = None,
) -> tuple[int, int]:
    """Unlink blocks last used at or before ``cutoff`` (and not within
    ``protect``), oldest first across every directory, until ``need``
    bytes are freed. (blocks, bytes)."""
    candidates = _list_candidates(inv, cutoff, now, protect, problems, stop)
    candidates.sort()
    check = _Check(inv, cutoff, now, protect, problems)
    # With events a batch is checked and announced whole, then unlinked: its
    # directories stay open in between (at most this many fds at once).
    batch = 1 if announce is None else max(1, min(announce.batch_events, _BATCH_DIRS))
    removed = freed = 0
    with DirHandles(keep=batch) as dirs:
        start = 0
        while start < len(candidates) and freed < need and not stop():
            # Only as many as may still be needed: a batch is announced whole.
            chosen: list[tuple[_Candidate, os.stat_result]] = []
            planned = freed
            while start < len(candidates) and len(chosen) < batch and planned < need:
                candidate = candidates[start]
                start += 1
                st = check.unused(candidate, dirs)
                if st is not None:
                    chosen.append((candidate, st))
                    planned += allocated(st)
            keys = _announce_removed(inv, chosen, announce)
            for index, (candidate, st) in enumerate(chosen):
                outcome = check.unlink(candidate, dirs)
                if outcome == _GONE:
                    continue  # removed by someone else: announced removed, rightly
                if outcome == _FAILED:
                    spared = keys[index]
                    if spared is not None and announce is not None:
                        announce.stored(spared)  # still there after all
                    continue
                removed += 1
                freed += allocated(st)
                inv.dir_entries[candidate.dir_id] -= 1
                emptied.add(candidate.dir_id)
    if announce is not None:
        announce.flush()
    return removed, freed


def _announce_removed(
    inv: Inventory,
    chosen: list[tuple[_Candidate, os.stat_result]],
    announce: Announcer | None,
) -> list[bytes | None]:
    """Publish a BlockRemoved for each chosen block (before its unlink);
    their keys, None where events are off or a name is not a block path."""
    if announce is None:
        return [None] * len(chosen)
    keys = []
    for candidate, _st in chosen:
        top = inv.top_of(candidate.dir_id)
        key = parse_block_path(top, f"{candidate.directory}/{candidate.name}")
        keys.append(key)
        if key is not None:
            announce.removed(key)
    announce.flush()
    return keys


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
        if kinds.classify(entry.name, st, kinds.RANK_AREA) != kinds.BLOCK:
            continue
        when = last_used(st)
        if when <= cutoff and now - when >= protect:
            found.append(_Candidate(when, directory, entry.name, dir_id, (st.st_dev, st.st_ino)))
    return found


class _Check:
    """The last look at a candidate before it goes, and its unlink."""

    def __init__(
        self, inv: Inventory, cutoff: float, now: float, protect: float, problems: Problems
    ):
        self.inv, self.cutoff, self.now, self.protect = inv, cutoff, now, protect
        self.problems = problems

    def unused(self, candidate: _Candidate, dirs: DirHandles) -> os.stat_result | None:
        """The candidate's stat if it is still the file listed and still
        unused since; None if spared, gone or failed (reported)."""
        path = f"{candidate.directory}/{candidate.name}"
        op = "open"
        try:
            fd = dirs.get(self.inv.top_of(candidate.dir_id), candidate.directory)
            op = "lstat"
            st = os.stat(candidate.name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.problems.add(exc, path, op)
            return None
        when = last_used(st)
        if (
            (st.st_dev, st.st_ino) != candidate.ident
            or not stat.S_ISREG(st.st_mode)
            or when > self.cutoff
            or self.now - when < self.protect
        ):
            return None  # republished, or loaded since it was listed
        return st

    def unlink(self, candidate: _Candidate, dirs: DirHandles) -> str:
        """Unlink the candidate: _REMOVED; _GONE if it (or its directory)
        was already gone; _FAILED if it is still there (reported)."""
        try:
            fd = dirs.get(self.inv.top_of(candidate.dir_id), candidate.directory)
            os.unlink(candidate.name, dir_fd=fd)
        except FileNotFoundError:
            return _GONE
        except OSError as exc:
            self.problems.add(exc, f"{candidate.directory}/{candidate.name}", "unlink")
            return _FAILED
        return _REMOVED


class DirHandles:
    """The fds of the directories acted in last, up to ``keep`` of them,
    kept open while the next actions are in the same ones: eviction in age
    order visits a directory's same-age blocks one after another, and with
    KV events a batch is first checked and announced, then unlinked, so each
    of its directories is used twice (keeping one fd would reopen every one
    of them). Not thread-safe; close() when done."""

    def __init__(self, keep: int = 1) -> None:
        self._keep = max(1, keep)
        self._fds: dict[str, int] = {}  # path -> fd, least recently used first

    def get(self, top: str, path: str) -> int:
        fd = self._fds.pop(path, -1)
        if fd < 0:
            fd = open_path_beneath(top, path)
            while len(self._fds) >= self._keep:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[path] = fd
        return fd

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> DirHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
