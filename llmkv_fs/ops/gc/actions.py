"""gc's actions on the volume. Each one re-checks what it is about to remove
right before removing it, never follows a symlink, and treats "already gone"
as done: live tiers keep writing while gc runs.

* A digest is first renamed, whole, to a hidden trash name in the root (one
  atomic rename per directory), then deleted there. Nothing under the live
  names is ever removed recursively.
* Temp files and evicted blocks are unlinked one by one after a fresh lstat
  (same inode, still old enough).
* Empty directories are removed bottom-up with ``rmdir`` only; a writer that
  creates a file meanwhile makes the rmdir fail (ENOTEMPTY), and the tier
  recreates a directory gc removed under it before its open.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable

from llmkv_fs.layout.blockfile import last_used
from llmkv_fs.layout.leases import read_leases
from llmkv_fs.layout.names import is_silly_rename_name, trash_path
from llmkv_fs.ops import scan
from llmkv_fs.ops.gc.inventory import DigestFacts, Inventory, allocated
from llmkv_fs.ops.gc.rules import Policy, digest_verdict, temp_verdict

__all__ = ["delete_tree", "evict", "prune_dirs", "remove_digest", "remove_temps"]


def _trash_name(facts: DigestFacts, rank: int | None) -> str:
    return trash_path(facts.digest.root, facts.digest.digest, rank, os.getpid(), time.time_ns())


# Directories below a trash top are opened relative to their parent's fd,
# never by path: a directory swapped for a symlink meanwhile (the trash lies
# in the root, which anyone with write access to the volume can change)
# cannot send the deletion elsewhere. Our trees are 4 levels deep.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_DEPTH = 32


def delete_tree(path: str, errors: list[str]) -> tuple[int, bool]:
    """Delete a tree gc has renamed out of the live namespace, bottom-up.
    Symlinks are unlinked, never followed (neither at the top nor below:
    every directory is opened ``O_NOFOLLOW`` relative to its parent).
    Returns (files removed, whether the tree is entirely gone). Leftovers
    (e.g. NFS ``.nfsXXXX`` files of a block another client still holds
    open) wait for the next run."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        return 0, True
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            errors.append(f"list {path}: {exc.strerror}")
            return 0, False
        try:  # not a directory: whatever took the trash name, itself
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as unlink_exc:
            errors.append(f"unlink {path}: {unlink_exc.strerror}")
            return 0, False
        return 1, True
    try:
        removed, complete = _delete_below(fd, path, errors, 0)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        complete = False
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            errors.append(f"rmdir {path}: {exc.strerror}")
    return removed, complete


def _delete_below(fd: int, where: str, errors: list[str], depth: int) -> tuple[int, bool]:
    """Empty the directory open as ``fd`` (``where`` names it in errors)."""
    removed, complete = 0, True
    try:
        with os.scandir(fd) as it:
            entries = list(it)
    except OSError as exc:
        errors.append(f"list {where}: {exc.strerror}")
        return 0, False
    for entry in entries:
        name, shown = entry.name, f"{where}/{entry.name}"
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        try:
            if not is_dir and is_silly_rename_name(name):
                # Another client's open file: removing it gives that reader
                # ESTALE instead of its bytes (NFSv3). Its client removes it
                # at the last close; the trash waits.
                complete = False
                continue
            if not is_dir:
                os.unlink(name, dir_fd=fd)
                removed += 1
                continue
            if depth >= _MAX_DEPTH:
                errors.append(f"not deleted, deeper than {_MAX_DEPTH} levels: {shown}")
                complete = False
                continue
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                os.unlink(name, dir_fd=fd)  # swapped for a link or file: that itself
                removed += 1
                continue
            try:
                sub_removed, sub_complete = _delete_below(child, shown, errors, depth + 1)
            finally:
                os.close(child)
            removed += sub_removed
            complete = complete and sub_complete
            os.rmdir(name, dir_fd=fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            complete = False
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                errors.append(f"remove {shown}: {exc.strerror}")
    return removed, complete


def remove_digest(
    facts: DigestFacts, policy: Policy, now: Callable[[], float], dry_run: bool, errors: list[str]
) -> tuple[bool, str]:
    """Re-read the leases, re-judge, then trash and delete the digest's
    config directory and every rank directory. (removed?, why)."""
    digest = facts.digest
    found = digest.lease_dir()
    facts.leases, facts.bad_leases = found.leases, found.bad
    remove, why = digest_verdict(facts, now(), policy)
    if not remove or dry_run:
        return remove, why
    trash: list[str] = []
    if digest.has_config_dir:
        target = _trash_name(facts, None)
        try:
            os.rename(digest.config_dir, target)
            trash.append(target)
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append(f"rename {digest.config_dir}: {exc.strerror}")
            return False, f"cannot move aside: {exc.strerror}"
        # A tier that started between the check and the rename left its
        # lease in there: give the directory back and keep the digest.
        if trash and any(x.is_live(now(), policy.lease_host) for x in read_leases(target)):
            with contextlib.suppress(OSError):
                os.rename(target, digest.config_dir)
                trash.pop()
            return False, "a live lease appeared while removing"
    for rank, path in sorted(digest.rank_dirs.items()):
        target = _trash_name(facts, rank)
        try:
            os.rename(path, target)
            trash.append(target)
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors.append(f"rename {path}: {exc.strerror}")
    for target in trash:
        delete_tree(target, errors)
    return True, why


def remove_temps(
    inv: Inventory, policy: Policy, now: float, dry_run: bool, emptied: set[int], errors: list[str]
) -> tuple[int, int, int]:
    """Remove dead writers' temp files. Returns (removed, bytes, kept)."""
    removed = freed = kept = 0
    for entry, dir_id, _digest in inv.temps:
        remove, _why = temp_verdict(entry, now, policy)
        if not remove:
            kept += 1
            continue
        try:
            st = os.lstat(entry.path)
        except FileNotFoundError:
            continue  # its writer finished (renamed it) or gave up
        if (st.st_ino, st.st_dev) != (entry.st.st_ino, entry.st.st_dev) or not stat.S_ISREG(
            st.st_mode
        ):
            kept += 1
            continue
        if not dry_run:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                errors.append(f"unlink {entry.path}: {exc.strerror}")
                continue
            inv.dir_entries[dir_id] -= 1
            emptied.add(dir_id)
        removed += 1
        freed += allocated(st)
    return removed, freed, kept


def evict(
    inv: Inventory,
    cutoff: float,
    need: int,
    now: float,
    protect: float,
    emptied: set[int],
    errors: list[str],
    stop: Callable[[], bool],
) -> tuple[int, int]:
    """Unlink blocks last used at or before ``cutoff`` (and not within
    ``protect``), oldest first, until ``need`` bytes are freed. Each
    directory holding a candidate is listed again and each block lstat'ed
    again, so a block loaded since the scan is spared. (blocks, bytes)."""
    import numpy as np

    used = np.frombuffer(inv.lru_used, dtype=np.float64)
    dirs = np.frombuffer(inv.lru_dir, dtype=np.int64)
    mask = used <= cutoff
    used, dirs = used[mask], dirs[mask]
    order = np.argsort(used, kind="stable")
    # Directories in the order of their oldest candidate.
    _unique, first = np.unique(dirs[order], return_index=True)
    dir_order = dirs[order][np.sort(first)]
    removed = freed = 0
    for dir_id in dir_order.tolist():
        if freed >= need or stop():
            break
        path = inv.dir_path[dir_id]
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError:
            continue
        found = []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if scan.classify(entry.name, st, scan.RANK_AREA) != scan.BLOCK:
                continue
            when = last_used(st)
            if when <= cutoff and now - when >= protect:
                found.append((when, entry.path, st))
        for _when, block, st in sorted(found):
            if freed >= need:
                break
            try:
                os.unlink(block)
            except FileNotFoundError:
                continue
            except OSError as exc:
                errors.append(f"unlink {block}: {exc.strerror}")
                continue
            removed += 1
            freed += allocated(st)
            inv.dir_entries[dir_id] -= 1
            emptied.add(dir_id)
    return removed, freed


def prune_dirs(
    inv: Inventory,
    prunable_digests: set[int],
    emptied: set[int],
    now: float,
    grace: float,
    dry_run: bool,
    errors: list[str],
) -> int:
    """rmdir empty directories under rank directories, deepest first (the
    rank directory itself stays). A directory that was already empty at
    scan time is left alone while younger than ``grace`` (a writer may be
    between its mkdir and its open); one gc emptied itself goes at once."""
    levels: dict[int, list[int]] = {}
    for dir_id, path in enumerate(inv.dir_path):
        if path is None or inv.dir_depth[dir_id] < 1 or not inv.dir_rank_area[dir_id]:
            continue
        if inv.dir_digest[dir_id] in prunable_digests and inv.dir_entries[dir_id] <= 0:
            levels.setdefault(inv.dir_depth[dir_id], []).append(dir_id)
    pruned = 0
    while levels:
        depth = max(levels)
        for dir_id in levels.pop(depth):
            path = inv.dir_path[dir_id]
            assert path is not None  # only directories with a path were queued
            if dir_id not in emptied:
                try:
                    if now - os.lstat(path).st_mtime < grace:
                        continue
                except FileNotFoundError:
                    continue
            if not dry_run:
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                        errors.append(f"rmdir {path}: {exc.strerror}")
                    continue
            pruned += 1
            parent = inv.dir_parent[dir_id]
            inv.dir_removed(dir_id)
            if parent >= 0:
                emptied.add(parent)
                if inv.dir_depth[parent] >= 1 and inv.dir_entries[parent] <= 0:
                    levels.setdefault(inv.dir_depth[parent], []).append(parent)
    return pruned
