"""Listing every directory under a set of top directories on a pool of
threads: gc's inventory, stats, verify and the events snapshot all walk
through it (``ops/scan.py`` sorts their roots out first).

Directory listing is the slow part on a network filesystem (one round trip
per ``getdents`` batch and, unless the client got attributes with the
listing, one per ``lstat``), so directories are listed on ``threads``
threads: every directory down to ``split_depth`` is its own work item, so
that many round trips are in flight whatever the tree's shape.

Every directory is opened relative to its parent's fd with ``O_NOFOLLOW``
(``volume/beneath.py``): a symlink is never followed, whenever it was planted,
and a tree deeper than PATH_MAX reads like any other. An entry that cannot
be read costs that entry only: it is recorded in its directory's listing
(``problems``, or the listing's ``error`` for the directory itself) and the
walk goes on. Something that vanished meanwhile is no problem: a live
volume changes while it is read.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import threading
from collections.abc import Generator, Iterable
from typing import NamedTuple

from llmkv_fs.layout.names import LEASES_DIRNAME, QUARANTINE_DIRNAME
from llmkv_fs.ops.kinds import CONFIG_AREA, RANK_AREA, FileEntry, classify
from llmkv_fs.ops.problems import MAX_DEPTH, TooDeep
from llmkv_fs.volume.beneath import OPEN_DIR_FLAGS, open_child_dir, open_path_beneath

__all__ = ["Listing", "walk"]


@dataclasses.dataclass
class Listing:
    """One directory, read once. Directories are numbered as they are found;
    ``parent`` is -1 for a top. ``files`` holds every non-directory entry
    (symlinks included, never followed); ``subdirs`` counts the real
    subdirectories, each of which comes as its own Listing. ``gone`` means it
    vanished before it could be read (a concurrent gc, or a digest renamed
    away); ``error`` is any other failure to read it (a symlink swapped in is
    ELOOP or ENOTDIR, never followed). ``problems``: ``(op, path, error)`` of
    each entry in it that could not be looked at (skipped)."""

    id: int
    parent: int
    top: int
    path: str
    depth: int
    files: list[FileEntry]
    subdirs: int
    gone: bool = False
    error: OSError | None = None
    problems: list[tuple[str, str, OSError]] = dataclasses.field(default_factory=list)


class _Item(NamedTuple):
    """A directory to read."""

    id: int
    parent: int
    top: int
    path: str
    depth: int
    in_quarantine: bool
    in_leases: bool


class _Walker:
    """A queue of directories to read and a pool of threads reading them.

    Directories down to ``split_depth`` are separate work items; deeper ones
    are read by the thread that read their parent, right after it (through
    the parent's fd), and reported in the same batch. With the layout's
    fan-out (4096 ``<hhh>`` directories per rank, at most 256 ``<hh>_g<g>``
    in each) that keeps thousands of items for the threads while paying the
    queue hand-off once per ``<hhh>`` instead of once per (often single-file)
    leaf directory.
    """

    def __init__(self, tops: list[tuple[str, str]], threads: int, split_depth: int):
        self.tops = tops
        self.threads = max(1, threads)
        self.split_depth = split_depth
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.ids = itertools.count()
        self.stop = threading.Event()

    @staticmethod
    def unread(item: _Item, exc: OSError) -> Listing:
        gone = isinstance(exc, FileNotFoundError)
        return Listing(
            item.id,
            item.parent,
            item.top,
            item.path,
            item.depth,
            [],
            0,
            gone=gone,
            error=None if gone else exc,
        )

    def list_dir(self, item: _Item, fd: int) -> tuple[Listing, list[_Item]]:
        area = self.tops[item.top][1]
        try:
            with os.scandir(fd) as it:
                entries = list(it)
        except OSError as exc:
            return self.unread(item, exc), []
        listing = Listing(item.id, item.parent, item.top, item.path, item.depth, [], 0)
        children: list[_Item] = []
        for entry in entries:
            path = f"{item.path}/{entry.name}"
            try:
                if entry.is_dir(follow_symlinks=False):
                    children.append(self.child(item, area, entry.name, path))
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile: nothing to report
            except OSError as exc:
                listing.problems.append(("stat", path, exc))
                continue
            kind = classify(entry.name, st, area, item.in_quarantine, item.in_leases)
            listing.files.append(FileEntry(path, kind, st))
        listing.subdirs = len(children)
        return listing, children

    def child(self, item: _Item, area: str, name: str, path: str) -> _Item:
        top_level = item.depth == 0
        quarantine = item.in_quarantine or (
            top_level and area == RANK_AREA and name == QUARANTINE_DIRNAME
        )
        leases = item.in_leases or (top_level and area == CONFIG_AREA and name == LEASES_DIRNAME)
        return _Item(next(self.ids), item.id, item.top, path, item.depth + 1, quarantine, leases)

    def read_subtree(self, item: _Item) -> tuple[list[Listing], list[_Item]]:
        """``item`` and everything below it down from ``split_depth``: the
        listings (each parent before its children) and the items to queue."""
        batch: list[Listing] = []
        queued: list[_Item] = []
        try:
            fd = open_path_beneath(self.tops[item.top][0], item.path)
        except OSError as exc:
            return [self.unread(item, exc)], []
        self.descend(item, fd, batch, queued)
        return batch, queued

    def descend(self, item: _Item, fd: int, batch: list[Listing], queued: list[_Item]) -> None:
        """List the directory open as ``fd`` (closing it), then its children
        deeper than ``split_depth``, each opened relative to it."""
        try:
            listing, children = self.list_dir(item, fd)
            batch.append(listing)
            for child in children:
                if self.stop.is_set():
                    return
                if child.depth <= self.split_depth:
                    queued.append(child)
                    continue
                if child.depth > MAX_DEPTH:
                    deep = TooDeep(f"more than {MAX_DEPTH} levels below {self.tops[item.top][0]}")
                    batch.append(self.unread(child, deep))
                    continue
                try:
                    child_fd = open_child_dir(
                        fd, os.path.basename(child.path), OPEN_DIR_FLAGS, child.path, must_read=True
                    )
                except OSError as exc:
                    batch.append(self.unread(child, exc))
                    continue
                self.descend(child, child_fd, batch, queued)
        finally:
            os.close(fd)

    def work(self) -> None:
        while not self.stop.is_set():
            item = self.todo.get()
            if item is None:
                return
            try:
                batch, queued = self.read_subtree(item)
            except BaseException as exc:  # never strand the consumer
                batch, queued = [self.unread(item, OSError(f"internal error: {exc!r}"))], []
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
        walker.todo.put(_Item(next(walker.ids), -1, top, path, 0, False, False))
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
