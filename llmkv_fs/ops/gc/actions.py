"""gc's actions on the volume. Each one re-checks what it is about to remove
right before removing it, never follows a symlink, and treats "already gone"
as done: live tiers keep writing while gc runs.

* A digest is first renamed, whole, to a hidden trash name in the root (one
  atomic rename per directory), then deleted there. Nothing under the live
  names is ever removed recursively.
* Temp files are unlinked one by one after a fresh lstat (same inode, still
  a regular file; their age is judged from the scan); evicted blocks
  likewise (``evict.py``).
* With KV events on, the blocks of a digest's trash are announced removed
  directory by directory before their unlinks (the rename took them from
  the tiers already: a router that still routes there meets a miss).
* Empty directories are removed bottom-up with ``rmdir`` only; a writer that
  creates a file meanwhile makes the rmdir fail (ENOTEMPTY), and the tier
  recreates a directory gc removed under it before its open.

Every action below a rank directory works through directory fds opened name
by name from it (``volume/beneath.py``): never through a symlink, and at any
depth. One that fails is recorded in the pass's ``Problems`` and skipped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmkv_fs.layout.names import is_silly_rename_name, parse_block_rel_path, trash_path
from llmkv_fs.ops.gc.evict import DirHandles, evict
from llmkv_fs.ops.gc.inventory import DigestFacts, Inventory, allocated
from llmkv_fs.ops.gc.rules import Policy, digest_verdict, temp_verdict
from llmkv_fs.ops.kinds import FileEntry
from llmkv_fs.ops.problems import MAX_DEPTH, Problems, TooDeep
from llmkv_fs.volume.beneath import OPEN_DIR_FLAGS
from llmkv_fs.volume.leases import read_leases

if TYPE_CHECKING:
    from llmkv_fs.ops.events.announcer import Announcer

__all__ = ["delete_tree", "evict", "prune_dirs", "remove_digest", "remove_temps"]


def _trash_name(facts: DigestFacts, rank: int | None) -> str:
    return trash_path(facts.digest.root, facts.digest.digest, rank, os.getpid(), time.time_ns())


# Directories below a trash top are opened relative to their parent's fd,
# never by path: a directory swapped for a symlink meanwhile (the trash lies
# in the root, which anyone with write access to the volume can change)
# cannot send the deletion elsewhere. Our trees are 4 levels deep.


def delete_tree(
    path: str, problems: Problems, announce: Announcer | None = None
) -> tuple[int, bool]:
    """Delete a tree gc has renamed out of the live namespace, bottom-up.
    Symlinks are unlinked, never followed (neither at the top nor below:
    every directory is opened ``O_NOFOLLOW`` relative to its parent).
    Returns (files removed, whether the tree is entirely gone). Leftovers
    (e.g. NFS ``.nfsXXXX`` files of a block another client still holds
    open) wait for the next run. Block files (a rank directory's layout
    below ``path``) are announced to ``announce`` before their unlink."""
    try:
        fd = os.open(path, OPEN_DIR_FLAGS)
    except FileNotFoundError:
        return 0, True
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            problems.add(exc, path, "list")
            return 0, False
        try:  # not a directory: whatever took the trash name, itself
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as unlink_exc:
            problems.add(unlink_exc, path, "unlink")
            return 0, False
        return 1, True
    try:
        removed, complete = _delete_below(fd, path, problems, 0, "", announce)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        complete = False
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            problems.add(exc, path, "rmdir")
    return removed, complete


def _delete_below(
    fd: int, where: str, problems: Problems, depth: int, rel: str, announce: Announcer | None
) -> tuple[int, bool]:
    """Empty the directory open as ``fd`` (``where``: its name in reports)."""
    removed, complete = 0, True
    try:
        with os.scandir(fd) as it:
            entries = list(it)
    except OSError as exc:
        problems.add(exc, where, "list")
        return 0, False
    if announce is not None:  # before the unlinks
        _announce_blocks(entries, rel, announce)
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
            if depth >= MAX_DEPTH:
                problems.add(
                    TooDeep(f"deeper than {MAX_DEPTH} levels, not deleted"), shown, "rmdir"
                )
                complete = False
                continue
            try:
                child = os.open(name, OPEN_DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                os.unlink(name, dir_fd=fd)  # swapped for a link or file: that itself
                removed += 1
                continue
            try:
                sub_removed, sub_complete = _delete_below(
                    child, shown, problems, depth + 1, f"{rel}{name}/", announce
                )
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
                problems.add(exc, shown, "remove")
    return removed, complete


def _announce_blocks(entries: list[os.DirEntry], rel: str, announce: Announcer) -> None:
    """Announce the block files among ``entries`` removed (a name that is
    not a block path of the layout -- config.json, a lease, a quarantined
    file, whose removal was announced when it was moved aside -- is not)."""
    for entry in entries:
        key = parse_block_rel_path(rel + entry.name)
        if key is not None and not entry.is_dir(follow_symlinks=False):
            announce.removed(key)
    announce.flush()


def remove_digest(
    facts: DigestFacts,
    policy: Policy,
    now: Callable[[], float],
    dry_run: bool,
    problems: Problems,
    announce: Announcer | None = None,
) -> tuple[bool, str]:
    """Re-read the leases, re-judge, then trash and delete the digest's
    config directory and every rank directory. Returns (removed -- or, with
    ``dry_run``, would be removed; why); a rank directory that could not be
    moved aside is reported in ``problems``, not in the flag."""
    digest = facts.digest
    facts.read_leases(problems)
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
            problems.add(exc, digest.config_dir, "rename")
            return False, f"cannot move aside: {exc.strerror}"
        # A tier that started between the check and the rename left its
        # lease in there: give the directory back and keep the digest.
        if trash and _live_lease_in(target, now(), policy, problems):
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
            problems.add(exc, path, "rename")
    for target in trash:
        delete_tree(target, problems, announce)
    return True, why


def _live_lease_in(config_dir: str, now: float, policy: Policy, problems: Problems) -> bool:
    """Whether the config directory just moved aside holds a live lease;
    leases that cannot be read count as live (the digest is given back)."""
    try:
        return any(x.is_live(now, policy.lease_host) for x in read_leases(config_dir))
    except OSError as exc:
        problems.add(exc, config_dir, "read leases")
        return True


def remove_temps(
    inv: Inventory,
    policy: Policy,
    now: float,
    dry_run: bool,
    emptied: set[int],
    problems: Problems,
) -> tuple[int, int, int]:
    """Remove dead writers' temp files. Returns (removed, bytes, kept)."""
    removed = freed = kept = 0
    with DirHandles() as dirs:
        for entry, dir_id, _digest in inv.temps:
            remove, _why = temp_verdict(entry, now, policy)
            if not remove:
                kept += 1
                continue
            gone = _remove_temp(inv, entry, dir_id, dirs, dry_run, problems)
            if gone is None:
                kept += 1
            elif gone:
                if not dry_run:
                    inv.dir_entries[dir_id] -= 1
                    emptied.add(dir_id)
                removed += 1
                freed += allocated(entry.st)
    return removed, freed, kept


def _remove_temp(
    inv: Inventory,
    entry: FileEntry,
    dir_id: int,
    dirs: DirHandles,
    dry_run: bool,
    problems: Problems,
) -> bool | None:
    """Unlink one temp file if it is still the file judged (same inode, a
    regular file). True: removed (or would be); False: gone already or
    failed (reported); None: something else holds the name now (kept)."""
    directory = inv.dir_path[dir_id]
    assert directory is not None
    name = os.path.basename(entry.path)
    op = "lstat"
    try:
        fd = dirs.get(inv.top_of(dir_id), directory)
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if (st.st_ino, st.st_dev) != (entry.st.st_ino, entry.st.st_dev) or not stat.S_ISREG(
            st.st_mode
        ):
            return None
        if not dry_run:
            op = "unlink"
            os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        return False  # its writer finished (renamed it) or gave up
    except OSError as exc:
        problems.add(exc, entry.path, op)
        return False
    return True


def prune_dirs(
    inv: Inventory,
    prunable_digests: set[int],
    emptied: set[int],
    now: float,
    grace: float,
    dry_run: bool,
    problems: Problems,
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
    with DirHandles() as dirs:
        while levels:
            depth = max(levels)
            for dir_id in levels.pop(depth):
                if not _prune_one(
                    inv, dir_id, dir_id not in emptied, now, grace, dry_run, dirs, problems
                ):
                    continue
                pruned += 1
                parent = inv.dir_parent[dir_id]
                inv.dir_removed(dir_id)
                if parent >= 0:
                    emptied.add(parent)
                    if inv.dir_depth[parent] >= 1 and inv.dir_entries[parent] <= 0:
                        levels.setdefault(inv.dir_depth[parent], []).append(parent)
    return pruned


def _prune_one(
    inv: Inventory,
    dir_id: int,
    check_age: bool,
    now: float,
    grace: float,
    dry_run: bool,
    dirs: DirHandles,
    problems: Problems,
) -> bool:
    """rmdir one directory through its parent's fd; whether it went (or,
    dry, would go). Not yet empty, gone or younger than ``grace`` (when
    ``check_age``): False, silently; any other failure: reported."""
    path = inv.dir_path[dir_id]
    parent = inv.dir_path[inv.dir_parent[dir_id]]
    assert path is not None and parent is not None  # only listed directories are queued
    name = os.path.basename(path)
    op = "lstat"
    try:
        fd = dirs.get(inv.top_of(dir_id), parent)
        if check_age and now - os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime < grace:
            return False
        if not dry_run:
            op = "rmdir"
            os.rmdir(name, dir_fd=fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            problems.add(exc, path, op)
        return False
    return True
