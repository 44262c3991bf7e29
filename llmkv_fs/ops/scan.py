"""Reading a cache volume's tree: digests, their rank directories, and every
file under them. Shared by gc, stats and verify; layout room only (no vLLM,
no engine), safe to run against a volume that live tiers are writing.

Directory listing is the slow part on a network filesystem (one round trip
per ``getdents`` batch and, unless the client got attributes with the
listing, one per ``lstat``), so ``walk`` lists directories on a pool of
threads: every directory found is queued at once, at every depth, so
``threads`` round trips are in flight whatever the tree's shape. Nothing is
ever followed through a symlink: entries are classified from ``lstat``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import stat
import threading
from collections.abc import Generator, Iterable
from typing import NamedTuple

from llmkv_fs.layout.fsinfo import filesystem_type
from llmkv_fs.layout.leases import Lease, LeaseDir, read_lease_dir
from llmkv_fs.layout.names import (
    CONFIG_FILENAME,
    LEASES_DIRNAME,
    QUARANTINE_DIRNAME,
    config_path,
    is_block_name,
    is_lease_name,
    is_silly_rename_name,
    is_temp_name,
    is_trash_name,
    parse_digest_dir_name,
    parse_rank_dir_name,
    temp_writer,
)
from llmkv_fs.layout.run_config import read_run_config, run_config_proves

__all__ = [
    "BLOCK",
    "CONFIG",
    "CONFIG_AREA",
    "LEASE",
    "OTHER",
    "QUARANTINED",
    "RANK_AREA",
    "SILLY_RENAMED",
    "SYMLINK",
    "TEMP",
    "Digest",
    "FileEntry",
    "Listing",
    "RootListing",
    "classify",
    "default_threads",
    "filesystem_type",
    "is_network_fs",
    "list_digests",
    "list_root",
    "temp_writer",
    "walk",
]

# File kinds. A symlink is always SYMLINK, wherever it is and whatever its name.
BLOCK, TEMP, QUARANTINED, OTHER = "block", "temp", "quarantined", "other"
CONFIG, LEASE, SYMLINK = "config", "lease", "symlink"
# An NFS client's ``.nfs<hex>`` file (layout/names.py): an unlinked file some
# client still has open. Never removed, never block data, never a sign of use.
SILLY_RENAMED = "silly_renamed"
# Which kind of top directory a walk started from.
RANK_AREA, CONFIG_AREA = "rank", "config"


@dataclasses.dataclass
class Digest:
    """One run config on the volume: ``<root>/<name>/`` (config.json,
    leases/) plus its ``<name>_r<rank>`` siblings. Either part may be
    missing (a crashed start, a half-finished gc)."""

    root: str
    name: str
    model: str
    digest: str
    has_config_dir: bool
    rank_dirs: dict[int, str]

    @property
    def config_dir(self) -> str:
        return f"{self.root}/{self.name}"

    def read_config(self) -> dict | None:
        """config.json's object, or None (missing, not a regular file --
        never followed, never blocked on --, not JSON, not an object)."""
        return self.config_status()[0]

    def config_status(self) -> tuple[dict | None, str]:
        """(config.json's object or None, why not)."""
        if not self.has_config_dir:
            return None, "no config directory"
        return read_run_config(config_path(self.config_dir))

    def config_proves_ours(self) -> tuple[bool, str]:
        """Whether config.json hashes to this directory's digest (then it is
        a cache digest beyond doubt), and if not, why not."""
        config, why = self.config_status()
        if config is None:
            return False, why
        if not run_config_proves(config, self.digest):
            return False, f"config.json does not hash to {self.digest}"
        return True, ""

    def lease_dir(self) -> LeaseDir:
        """Valid leases and bad files at lease names (never raises)."""
        return read_lease_dir(self.config_dir) if self.has_config_dir else LeaseDir([], [])

    def leases(self) -> list[Lease]:
        return self.lease_dir().leases


@dataclasses.dataclass(frozen=True)
class RootListing:
    """The root directory, sorted out: digests, gc's own trash, symlinks
    (never followed) and anything else (left alone)."""

    digests: list[Digest]
    trash: list[str]
    symlinks: list[str]
    other: list[str]


class FileEntry(NamedTuple):
    """One non-directory entry and its lstat. (A tuple: a scan makes one per
    file, millions of them.)"""

    path: str
    kind: str  # one of the kinds above
    st: os.stat_result


@dataclasses.dataclass
class Listing:
    """One directory, read once. Directories are numbered as they are found;
    ``parent`` is -1 for a top. ``files`` holds every non-directory entry
    (symlinks included, never followed); ``subdirs`` counts the real
    subdirectories, each of which comes as its own Listing. ``gone`` means it
    vanished before it could be read (a concurrent gc, or a digest renamed
    away); ``error`` is any other failure to read it."""

    id: int
    parent: int
    top: int
    path: str
    depth: int
    files: list[FileEntry]
    subdirs: int
    gone: bool = False
    error: OSError | None = None


# Filesystems where a metadata operation is a network round trip (or a FUSE
# hop): there, concurrent listing pays off. On local ones (ext4, xfs, tmpfs,
# ...) a thread pool only adds GIL hand-offs: measured 4x slower with 16
# threads than with 1 on ext4 (docs/gc.md).
_NETWORK_FS = (
    "nfs",
    "nfs4",
    "ceph",
    "lustre",
    "glusterfs",
    "cifs",
    "smb3",
    "smbfs",
    "gpfs",
    "beegfs",
    "9p",
    "afs",
    "gfs2",
    "ocfs2",
    "panfs",
    "pvfs2",
    "orangefs",
    "wekafs",
    "virtiofs",
)


def is_network_fs(fstype: str) -> bool:
    return fstype in _NETWORK_FS or fstype.startswith("fuse")


def default_threads(path: str) -> int:
    """16 listings in flight on a network (or FUSE) filesystem, 1 on a local one."""
    return 16 if is_network_fs(filesystem_type(path)) else 1


def list_root(root: str) -> RootListing:
    """Sort out ``root``'s entries. Symlinks are collected, never followed."""
    found: dict[str, Digest] = {}
    trash, symlinks, other = [], [], []
    with os.scandir(root) as it:
        entries = list(it)
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_link = not is_dir and entry.is_symlink()
        except OSError:
            continue
        if is_link:
            symlinks.append(entry.path)
            continue
        if not is_dir:
            other.append(entry.path)
            continue
        if is_trash_name(entry.name):
            trash.append(entry.path)
            continue
        rank = parse_rank_dir_name(entry.name)
        base_name = rank.digest_dir_name if rank else entry.name
        parsed = parse_digest_dir_name(base_name)
        if parsed is None:
            other.append(entry.path)
            continue
        digest = found.setdefault(
            base_name, Digest(root, base_name, parsed.model, parsed.digest, False, {})
        )
        if rank:
            digest.rank_dirs[rank.rank] = entry.path
        else:
            digest.has_config_dir = True
    return RootListing(
        [found[name] for name in sorted(found)], sorted(trash), sorted(symlinks), sorted(other)
    )


def list_digests(root: str) -> list[Digest]:
    """Every digest under ``root``, sorted by name. Entries that are not
    directories, or symlinks, are ignored: gc must never follow a link out of
    the volume."""
    return list_root(root).digests


def classify(
    name: str, st: os.stat_result, area: str, in_quarantine: bool = False, in_leases: bool = False
) -> str:
    """The kind of a non-directory entry, from its name, its lstat and where
    it lies (``area``: under a rank or a config directory)."""
    if stat.S_ISLNK(st.st_mode):
        return SYMLINK
    if is_silly_rename_name(name):
        return SILLY_RENAMED
    if is_temp_name(name):
        return TEMP
    if not stat.S_ISREG(st.st_mode):
        return OTHER
    if area == RANK_AREA:
        if in_quarantine:
            return QUARANTINED
        return BLOCK if is_block_name(name) else OTHER
    if in_leases and is_lease_name(name):
        return LEASE
    if not in_leases and name == CONFIG_FILENAME:
        return CONFIG
    return OTHER


# A work item: (id, parent id, top index, path, depth, in quarantine, in leases).
_Item = tuple[int, int, int, str, int, bool, bool]


class _Walker:
    """A queue of directories to read and a pool of threads reading them.

    Directories down to ``split_depth`` are separate work items; deeper ones
    are read by the thread that read their parent, right after it, and
    reported in the same batch. With the layout's fan-out (4096 ``<hhh>``
    directories per rank, at most 256 ``<hh>_g<g>`` in each) that keeps
    thousands of items for the threads while paying the queue hand-off once
    per ``<hhh>`` instead of once per (often single-file) leaf directory.
    """

    def __init__(self, tops: list[tuple[str, str]], threads: int, split_depth: int):
        self.tops = tops
        self.threads = max(1, threads)
        self.split_depth = split_depth
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.ids = itertools.count()
        self.stop = threading.Event()

    def read(self, item: _Item) -> tuple[Listing, list[_Item]]:
        dir_id, parent, top, path, depth, in_quarantine, in_leases = item
        area = self.tops[top][1]
        files: list[FileEntry] = []
        children: list[_Item] = []
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return Listing(dir_id, parent, top, path, depth, [], 0, gone=True), []
        except OSError as exc:
            return Listing(dir_id, parent, top, path, depth, [], 0, error=exc), []
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    quarantine = in_quarantine or (
                        depth == 0 and area == RANK_AREA and entry.name == QUARANTINE_DIRNAME
                    )
                    leases = in_leases or (
                        depth == 0 and area == CONFIG_AREA and entry.name == LEASES_DIRNAME
                    )
                    children.append(
                        (next(self.ids), dir_id, top, entry.path, depth + 1, quarantine, leases)
                    )
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile: nothing to report
            files.append(
                FileEntry(entry.path, classify(entry.name, st, area, in_quarantine, in_leases), st)
            )
        return Listing(dir_id, parent, top, path, depth, files, len(children)), children

    def read_subtree(self, item: _Item) -> tuple[list[Listing], list[_Item]]:
        """``item`` and everything below it down from ``split_depth``: the
        listings (each parent before its children) and the items to queue."""
        batch: list[Listing] = []
        queued: list[_Item] = []
        stack = [item]
        while stack and not self.stop.is_set():
            listing, children = self.read(stack.pop())
            batch.append(listing)
            for child in children:
                (stack if child[4] > self.split_depth else queued).append(child)
        return batch, queued

    def work(self) -> None:
        while not self.stop.is_set():
            item = self.todo.get()
            if item is None:
                return
            try:
                batch, queued = self.read_subtree(item)
            except BaseException as exc:  # never strand the consumer
                batch, queued = (
                    [
                        Listing(
                            item[0],
                            item[1],
                            item[2],
                            item[3],
                            item[4],
                            [],
                            0,
                            error=OSError(str(exc)),
                        )
                    ],
                    [],
                )
            # The batch goes out before its children are queued, so the
            # consumer always sees a parent before its children.
            self.done.put((batch, len(queued)))
            for child in queued:
                self.todo.put(child)


def walk(
    tops: Iterable[str | tuple[str, str]], threads: int = 16, split_depth: int = 1
) -> Generator[Listing, None, None]:
    """Every directory under ``tops`` (each a rank directory, or a
    ``(path, area)`` pair), each directory listed once, with its files
    lstat'ed. A directory's Listing always comes before its children's.
    Order across directories is otherwise unspecified. ``split_depth``: see
    ``_Walker`` (0 hands whole tops to threads; a large value makes every
    directory its own work item)."""
    pairs = [(t, RANK_AREA) if isinstance(t, str) else (t[0], t[1]) for t in tops]
    if not pairs:
        return
    walker = _Walker(pairs, threads, split_depth)
    for top, (path, _area) in enumerate(pairs):
        walker.todo.put((next(walker.ids), -1, top, path, 0, False, False))
    outstanding = len(pairs)
    pool = [
        threading.Thread(target=walker.work, name=f"llmkv-scan-{i}", daemon=True)
        for i in range(min(walker.threads, 256))
    ]
    for thread in pool:
        thread.start()
    try:
        while outstanding:
            batch, queued = walker.done.get()
            # Its queued children are (about to be) in the queue: count them in.
            outstanding += queued - 1
            yield from batch
    finally:
        walker.stop.set()
        for _ in pool:
            walker.todo.put(None)
        for thread in pool:
            thread.join()
