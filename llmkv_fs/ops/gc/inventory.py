"""What one scan found, kept small enough for millions of blocks.

The walk streams directory listings (``ops/walker.py``); this module folds them
into per-digest facts (newest activity, sizes), the temp files and symlinks
it saw, the directory tree (for pruning) and, for every block that capacity
eviction may take, three numbers: last use, allocated bytes and directory.
Block names are not kept: eviction re-reads the few directories it acts in,
which also re-checks each block right before it is removed. About 24 bytes
per block (three 8-byte array entries) plus one path per directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from array import array
from collections.abc import Callable

from llmkv_fs.layout.blockfile import last_used
from llmkv_fs.layout.names import parse_block_path, parse_quarantine_name
from llmkv_fs.ops import kinds, walker
from llmkv_fs.ops.kinds import FileEntry
from llmkv_fs.ops.problems import Problems
from llmkv_fs.ops.scan import Digest
from llmkv_fs.volume.leases import BadLease, Lease

__all__ = ["DigestFacts", "Inventory", "allocated", "take_inventory"]


def allocated(st: os.stat_result) -> int:
    """Bytes a file occupies (what removing it gives back); the apparent
    size where the filesystem does not report blocks."""
    return st.st_blocks * 512 if st.st_blocks else st.st_size


@dataclasses.dataclass
class DigestFacts:
    digest: Digest
    selected: bool  # passes --model
    pinned: bool  # named by --keep
    leases: list[Lease] = dataclasses.field(default_factory=list)
    bad_leases: list[BadLease] = dataclasses.field(default_factory=list)
    lease_error: str = ""  # why leases/ could not be read: then nothing is removed
    # Whether config.json proves the directory a cache digest (checked
    # before the scan); if not, why not, and what the scan found: files
    # with our names, and anything else (``foreign``, first one named).
    proven: bool = False
    unproven_why: str = ""
    ours: int = 0
    foreign: int = 0
    foreign_example: str = ""
    newest: float = 0.0  # newest sign of use: a block's last use, any other file's mtime
    newest_what: str = ""
    files: int = 0
    bytes: int = 0
    blocks: int = 0
    block_bytes: int = 0
    temps: int = 0
    quarantined: int = 0
    symlinks: int = 0
    silly_renamed: int = 0  # NFS .nfs<hex> files: counted, never removed
    silly_renamed_bytes: int = 0
    # Directories and files the scan could not read: what they hold or how
    # recently they were used is unknown, so the digest is never removed.
    unreadable: int = 0

    def saw(self, when: float, what: str) -> None:
        if when > self.newest:
            self.newest, self.newest_what = when, what

    def read_leases(self, problems: Problems) -> None:
        """(Re-)read the digest's leases; one that cannot be read keeps the
        digest (``lease_error``) and is reported (once a pass)."""
        try:
            found = self.digest.lease_dir()
        except OSError as exc:
            if not self.lease_error:
                problems.add(exc, exc.filename or self.digest.config_dir, "read leases")
            self.leases, self.bad_leases = [], []
            self.lease_error = exc.strerror or str(exc)
            return
        self.leases, self.bad_leases, self.lease_error = found.leases, found.bad, ""

    def check_ownership(self) -> None:
        """Set ``proven`` from config.json (a FIFO or link there is never
        opened: it simply proves nothing)."""
        self.proven, self.unproven_why = self.digest.config_proves_ours()

    def provably_ours(self) -> tuple[bool, str]:
        """gc deletes only what it can prove is a cache digest: config.json
        hashes to the directory's digest, or -- its config directory gone,
        e.g. a gc interrupted between its renames -- everything in it bears
        our names (blocks, temp files, leases, quarantined files) and there
        is at least one such file. (ours?, why not)."""
        if self.proven:
            return True, ""
        if self.foreign:
            return False, (
                f"{self.unproven_why}; {self.foreign} entries not ours, e.g. {self.foreign_example}"
            )
        if not self.ours:
            return False, f"{self.unproven_why}; nothing of ours in it"
        return True, ""


@dataclasses.dataclass
class Inventory:
    root: str
    digests: list[DigestFacts]
    # Directories by scan id: path, parent id, depth (0 = a top), whether
    # it lies under a rank directory of a digest, entries at scan time.
    dir_path: list[str | None] = dataclasses.field(default_factory=list)
    dir_parent: array = dataclasses.field(default_factory=lambda: array("q"))
    dir_depth: array = dataclasses.field(default_factory=lambda: array("q"))
    dir_digest: array = dataclasses.field(default_factory=lambda: array("q"))
    dir_rank_area: array = dataclasses.field(default_factory=lambda: array("b"))
    dir_entries: array = dataclasses.field(default_factory=lambda: array("q"))
    # Blocks capacity eviction may take (selected, unpinned digests).
    lru_used: array = dataclasses.field(default_factory=lambda: array("d"))
    lru_bytes: array = dataclasses.field(default_factory=lambda: array("q"))
    lru_dir: array = dataclasses.field(default_factory=lambda: array("q"))
    # (entry, directory id, digest index) of every temp file.
    temps: list[tuple[FileEntry, int, int]] = dataclasses.field(default_factory=list)
    symlinks: list[str] = dataclasses.field(default_factory=list)
    problems: Problems = dataclasses.field(default_factory=Problems)
    files: int = 0
    dirs: int = 0
    bytes: int = 0  # every file under a selected digest
    silly_renamed: int = 0  # NFS .nfs<hex> files seen (not in files or bytes)
    scan_seconds: float = 0.0
    complete: bool = True

    def _grow(self, dir_id: int) -> None:
        missing = dir_id + 1 - len(self.dir_path)
        if missing > 0:
            self.dir_path.extend([None] * missing)
            for arr, fill in (
                (self.dir_parent, -1),
                (self.dir_depth, 0),
                (self.dir_digest, -1),
                (self.dir_rank_area, 0),
                (self.dir_entries, 0),
            ):
                arr.extend([fill] * missing)

    def top_of(self, dir_id: int) -> str:
        """The rank or config directory ``dir_id`` lies in (actions open
        directories below it name by name: ``volume/beneath.py``)."""
        while self.dir_depth[dir_id] > 0:
            dir_id = self.dir_parent[dir_id]
        path = self.dir_path[dir_id]
        assert path is not None  # a directory's top was listed before it
        return path

    def dir_removed(self, dir_id: int) -> None:
        """One entry fewer in ``dir_id``'s parent (it was pruned or it vanished)."""
        parent = self.dir_parent[dir_id]
        if parent >= 0:
            self.dir_entries[parent] -= 1


def take_inventory(
    root: str,
    digests: list[DigestFacts],
    threads: int,
    progress: Callable[[Inventory], None] | None = None,
    stop: Callable[[], bool] | None = None,
    problems: Problems | None = None,
) -> Inventory:
    """Walk every digest's config and rank directories once. ``complete``
    is False when ``stop`` cut the walk short (nothing may be judged then).
    What could not be read goes to ``problems`` (and keeps its digest)."""
    inv = Inventory(root, digests, problems=problems if problems is not None else Problems())
    tops: list[tuple[str, str]] = []
    top_digest: list[int] = []
    for index, facts in enumerate(digests):
        if facts.digest.has_config_dir:
            tops.append((facts.digest.config_dir, kinds.CONFIG_AREA))
            top_digest.append(index)
        for _rank, path in sorted(facts.digest.rank_dirs.items()):
            tops.append((path, kinds.RANK_AREA))
            top_digest.append(index)
    started = time.monotonic()
    with contextlib.closing(walker.walk(tops, threads)) as listings:
        for listing in listings:
            digest_index = top_digest[listing.top]
            facts = digests[digest_index]
            top, area = tops[listing.top]
            if _take(inv, facts, digest_index, listing, area == kinds.RANK_AREA):
                _fold(inv, facts, digest_index, listing)
                if not facts.proven:
                    _judge_names(facts, listing, top, area)
            if progress is not None:
                progress(inv)
            if stop is not None and stop():
                inv.complete = False
                break
    inv.scan_seconds = time.monotonic() - started
    for facts in digests:
        if facts.newest == 0.0:
            _empty_digest_age(facts)
    return inv


def _take(
    inv: Inventory, facts: DigestFacts, digest_index: int, listing: walker.Listing, rank_area: bool
) -> bool:
    """Record ``listing``'s directory and what could not be read in it;
    whether its files are there to fold in."""
    inv._grow(listing.id)
    inv.dir_path[listing.id] = listing.path
    inv.dir_parent[listing.id] = listing.parent
    inv.dir_depth[listing.id] = listing.depth
    inv.dir_digest[listing.id] = digest_index
    inv.dir_rank_area[listing.id] = rank_area
    # Entries that could not be looked at still count: pruning must not
    # take their directory for empty (nor one it could not read at all).
    inv.dir_entries[listing.id] = len(listing.files) + listing.subdirs + len(listing.problems)
    inv.dirs += 1
    if listing.gone:
        inv.dir_removed(listing.id)
        return False
    if listing.error is not None:
        inv.dir_entries[listing.id] = 1
        facts.unreadable += 1
        inv.problems.add(listing.error, listing.path, "list")
        return False
    for op, path, exc in listing.problems:
        facts.unreadable += 1
        inv.problems.add(exc, path, op)
    return True


def _empty_digest_age(facts: DigestFacts) -> None:
    """A digest without a single file (a tier between its mkdir and its
    config.json, or leftovers): its directories' mtimes are its only age.
    Never used otherwise -- gc's own pruning touches them."""
    digest = facts.digest
    tops = ([digest.config_dir] if digest.has_config_dir else []) + list(digest.rank_dirs.values())
    for path in tops:
        try:
            facts.saw(os.lstat(path).st_mtime, path)
        except OSError:
            continue


def _fold(inv: Inventory, facts: DigestFacts, digest_index: int, listing: walker.Listing) -> None:
    # Never evict from a digest config.json does not prove ours.
    lru_ok = facts.selected and not facts.pinned and facts.proven
    for entry in listing.files:
        st, kind = entry.st, entry.kind
        if kind == kinds.SILLY_RENAMED:
            # Space an NFS client frees at its last close; not ours to free
            # and no sign of use (its mtime is the old block's).
            facts.silly_renamed += 1
            facts.silly_renamed_bytes += allocated(st)
            inv.silly_renamed += 1
            continue
        inv.files += 1
        facts.files += 1
        size = allocated(st) if kind != kinds.SYMLINK else 0
        facts.bytes += size
        if facts.selected:
            inv.bytes += size
        if kind == kinds.BLOCK:
            used = last_used(st)
            facts.blocks += 1
            facts.block_bytes += size
            facts.saw(used, entry.path)
            if lru_ok:
                inv.lru_used.append(used)
                inv.lru_bytes.append(size)
                inv.lru_dir.append(listing.id)
        elif kind == kinds.TEMP:
            facts.temps += 1
            facts.saw(st.st_mtime, entry.path)
            inv.temps.append((entry, listing.id, digest_index))
        elif kind == kinds.SYMLINK:
            facts.symlinks += 1
            inv.symlinks.append(entry.path)
        elif kind == kinds.LEASE:
            pass  # liveness is judged from the lease itself, not as activity
        else:
            if kind == kinds.QUARANTINED:
                facts.quarantined += 1
            facts.saw(st.st_mtime, entry.path)


def _is_our_name(entry: FileEntry, top: str, area: str) -> bool:
    kind = entry.kind
    if kind in (kinds.TEMP, kinds.LEASE):
        return True
    if kind == kinds.QUARANTINED:
        return parse_quarantine_name(os.path.basename(entry.path)) is not None
    if kind == kinds.BLOCK and area == kinds.RANK_AREA:
        return parse_block_path(top, entry.path) is not None
    # A config.json that does not prove the digest, a symlink, anything else.
    return False


def _judge_names(facts: DigestFacts, listing: walker.Listing, top: str, area: str) -> None:
    """Count ``listing``'s files of a digest config.json does not prove as
    ours or foreign (``DigestFacts.provably_ours``)."""
    for entry in listing.files:
        if _is_our_name(entry, top, area):
            facts.ours += 1
        else:
            facts.foreign += 1
            if not facts.foreign_example:
                facts.foreign_example = os.path.relpath(entry.path, facts.digest.root)
