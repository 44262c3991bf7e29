"""What happened to each block, and the keys the engine counts it under.

This is the engine's contract with whoever publishes its counters
(tier/metrics.py maps every key below onto a Prometheus series). Adding a
failure reason is one edit: a ``Failure`` member, whose value is its metric
label; tests/tier/test_metrics.py then asks for its line in docs/metrics.md.

Threading: plain immutable values. An I/O thread creates a block's result
(``Outcome`` or ``Failed``); only the owner counts it.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import itertools
from collections.abc import Iterator
from typing import ClassVar, TypeAlias

from llmkv_fs.layout.blockfile import BlockFileError, Corruption
from llmkv_fs.layout.sealed import ForeignKey

__all__ = [
    "CANCELLED",
    "DEADLINE",
    "SKIPPED",
    "Abandoned",
    "BlockMissing",
    "BlockNotMoved",
    "BlockOnLostRoot",
    "BlockResult",
    "CounterKey",
    "Direction",
    "Failed",
    "Failure",
    "LookupAnswer",
    "MissReason",
    "NoChecksum",
    "Outcome",
    "StoreRefused",
    "Tally",
    "all_counter_keys",
    "failed",
]


class _CounterKeyEnum(enum.Enum):
    """Hashed by identity (members are singletons). Enum's own ``__hash__`` is
    Python code hashing the member's name, and every counted block and every
    lookup pays it twice."""

    __hash__ = object.__hash__


class Direction(_CounterKeyEnum):
    LOAD = "load"  # volume -> primary buffer
    STORE = "store"  # primary buffer -> volume


class Outcome(_CounterKeyEnum):
    """A block that succeeded, and how. Anything else is a ``Failed``."""

    WRITTEN = "written"  # store: published a new file
    PRESENT = "present"  # store: a block file this replica can load was already there
    # store: published over a file this replica can prove it would not load
    # (block/blockio.py: not a block file by its size, a bad trailer, sealed
    # with a key it does not hold, no checksum where it wants one)
    REPLACED = "replaced"
    VERIFIED = "verified"  # load: trailer, length, key and payload checksum checked
    # load: served without a checksum check -- a trailer-less file (vLLM's
    # built-in wrote it), a file written with checksum: false, or this reader
    # has checksum: false. Never counted as verified.
    UNVERIFIED = "unverified"

    @property
    def direction(self) -> Direction:
        stores = (Outcome.WRITTEN, Outcome.PRESENT, Outcome.REPLACED)
        return Direction.STORE if self in stores else Direction.LOAD


class Failure(_CounterKeyEnum):
    """Why a block was not moved. The value is the ``reason`` label of the
    ``store_failures`` / ``load_failures`` metrics."""

    MISSING = "missing"  # load: no file (never stored, or removed since the lookup)
    CORRUPT = "corrupt"  # load: the file failed verification (see Corruption)
    QUEUE_FULL = "queue_full"  # store: max_pending_store_bytes were already waiting
    SPACE = "space"  # store: the space guard is tripped
    STALLED = "stalled"  # refused at submit: the volume is not answering
    ROOT_LOST = "volume_failed"  # root_dir is gone or not the directory the tier started on
    DEADLINE = "deadline"  # the job passed job_timeout_s
    ERROR = "error"  # any other exception (logged, throttled)
    # the I/O worker process running the block died (crash, SIGKILL, OOM);
    # says nothing about the file, so the key is not remembered as a miss
    WORKER_DIED = "worker_died"
    CANCELLED = "cancelled"  # never started: the engine shut down
    # load: the file has no payload checksum (written with checksum: false)
    # and this reader wants one; refused without accept_trailerless, left in place
    NO_CHECKSUM = "no_checksum"
    # load: an earlier block of the same job failed. vLLM can use only the
    # blocks before the first failure (its built-in stops there), so the rest
    # is not read, or, if already in flight on another thread, not delivered
    SKIPPED = "skipped"
    # a directory on the block's path below root_dir is a symlink: never
    # followed (volume.beneath), so nothing is stored or read through it
    LINK_IN_TREE = "link_in_tree"
    # load: a sealed block of a key this reader does not hold (an unknown key
    # id, or another deployment's key under one of ours): not corrupt, left
    # in place (layout/sealed.py)
    FOREIGN_KEY = "foreign_key"


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """A block that was not moved: why, and the exception behind it (for the
    log; a BlockFileError for CORRUPT)."""

    reason: Failure
    error: Exception | None = None


BlockResult: TypeAlias = Outcome | Failed

# Shared results of blocks failed without running (no allocation per block).
CANCELLED = Failed(Failure.CANCELLED)
DEADLINE = Failed(Failure.DEADLINE)
SKIPPED = Failed(Failure.SKIPPED)


class BlockNotMoved(Exception):
    """An expected per-block failure raised in a block step (an I/O thread or a
    worker process); ``failure`` says which."""

    failure: ClassVar[Failure] = Failure.ERROR


class BlockMissing(BlockNotMoved):
    """The block file does not exist (never stored, or removed)."""

    failure = Failure.MISSING


class Abandoned(BlockNotMoved):
    """The store's job passed its deadline while the block was being written;
    the temp file was removed instead of published."""

    failure = Failure.DEADLINE


class NoChecksum(BlockNotMoved):
    """The block file carries no payload checksum and the reader wants one
    (see ``accept_trailerless``). Not corrupt: it stays where it is."""

    failure = Failure.NO_CHECKSUM


class StoreRefused(BlockNotMoved):
    """A store block was not attempted (the space guard is tripped)."""

    failure = Failure.SPACE


class BlockOnLostRoot(BlockNotMoved):
    """The block was not attempted, or stopped short of creating a
    directory: root_dir is not the directory the tier started on."""

    failure = Failure.ROOT_LOST


def failed(exc: Exception) -> Failed:
    """The result of a block whose transfer raised ``exc``."""
    if isinstance(exc, BlockNotMoved):
        return Failed(exc.failure, exc)
    if isinstance(exc, BlockFileError):
        return Failed(Failure.CORRUPT, exc)
    if isinstance(exc, ForeignKey):
        return Failed(Failure.FOREIGN_KEY, exc)
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        # Only a walk beneath the root that met a symlink raises ELOOP
        # (volume.beneath.LinkInTree; a link at the block's own name is a
        # BlockFileError or is replaced by the store's rename). Matched by
        # errno: from a worker process it arrives as a bare OSError.
        return Failed(Failure.LINK_IN_TREE, exc)
    return Failed(Failure.ERROR, exc)


class LookupAnswer(_CounterKeyEnum):
    """A lookup's answer, as counted. The value is the ``lookups`` metric's
    ``result`` label."""

    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"  # the existence check is still running
    DEADLINE_MISS = "deadline_miss"  # a pending check answered miss after its deadline


class MissReason(_CounterKeyEnum):
    """Why a lookup answered miss, counted per lookup answered ``MISS`` (so
    the reasons sum to ``LookupAnswer.MISS``). The value is the
    ``lookup_misses`` metric's ``reason`` label."""

    NOT_ON_VOLUME = "not_on_volume"  # a check looked: no block file there
    LOST_ROOT = "lost_root"  # refused: the key's home root is lost (volume_failed)
    STALLED = "stalled"  # refused: the volume is not answering
    DEADLINE = "deadline"  # the lookup deadline answered before the check did
    CHECK_FAILED = "check_failed"  # the check failed (EIO, ...) or its root was lost meanwhile
    REMEMBERED_BAD = "remembered_bad"  # a file whose load failed and would fail again
    FOREIGN_KEY = "foreign_key"  # sealed with a key this replica does not hold
    LOAD_FAILED = "load_failed"  # its load failed (corrupt and moved aside, gone, ...)


class Tally(_CounterKeyEnum):
    """Counters with no label."""

    BYTES_WRITTEN = enum.auto()
    BYTES_READ = enum.auto()
    QUARANTINED = enum.auto()  # bad block files moved aside
    DEADLINE_EXPIRED = enum.auto()  # blocks failed when their job's deadline passed
    WORKER_DEATHS = enum.auto()  # I/O worker processes that died and were replaced


# What FsEngine.counters is keyed by: successes by Outcome, failures by
# (direction, reason), bad files by what was wrong with them, lookups by answer,
# missed lookups by why.
CounterKey: TypeAlias = (
    Outcome | tuple[Direction, Failure] | Corruption | LookupAnswer | MissReason | Tally
)


def all_counter_keys() -> Iterator[CounterKey]:
    """Every key FsEngine.counters can hold (for the metric table's tests)."""
    yield from Outcome
    yield from itertools.product(Direction, Failure)
    yield from Corruption
    yield from LookupAnswer
    yield from MissReason
    yield from Tally
