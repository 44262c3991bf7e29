"""One block, start to end: every check a block passes before and while it
moves, and its result. An I/O thread of the engine and an I/O worker process
call the same ``BlockStep.run``, so the two modes cannot drift apart (they
did: a worker stored to a volume the engine had declared failed).

The checks, in order: the job still wants the block (its deadline); the
chunk index lies inside the primary buffer (a memoryview slice would clamp
silently and copy the wrong bytes); root_dir is still the directory the tier
started on (shared ``VolumeSignals``, one page per root); for a store, the
space guard admits it (both read from the root's ``VolumeSignals``, the
page the engine's housekeeping writes). Then the block moves (``BlockIO``)
on the root its key is placed on (a load also tries the key's second
choice, see ``RootPlacement``). A store or load that finds the root gone
underneath it (pinned root, ``RootGone``: unmounted or replaced since the
last housekeeping check) fails VOLUME_FAILED -- never remembered as a bad
file, and a load then tries the key's next choice; ENOSPC trips the space
guard right there, with the free space of that moment.

Threading: a BlockStep is shared by the I/O threads of one process; it
holds no mutable state of its own (BlockIO keeps per-thread scratch).
``run`` blocks on the filesystem and never raises.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.bytes_c import compiled_slices
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.outcomes import (
    DEADLINE,
    SKIPPED,
    BlockMissing,
    BlockNotMoved,
    BlockResult,
    Outcome,
    StoreRefused,
    VolumeFailed,
    failed,
)
from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.engine.upkeep.space import trip_on_enospc
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.volume.pinned_root import RootGone

__all__ = ["BlockStep", "StepRoot"]

_SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT))
_E = TypeVar("_E", bound=BaseException)


def without_tracebacks(exc: _E) -> _E:
    """Drop the frames an exception holds: they reference the primary-buffer
    row being copied, and a result keeping that alive stops vLLM from
    unmapping the region at shutdown."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


class StepRoot(NamedTuple):
    """One root as a block step sees it: how blocks move there, and its
    shared signals (lost? stores refused?)."""

    blockio: BlockIO
    signals: VolumeSignals


class BlockStep:
    """See the module doc. ``rows`` is the primary buffer as one flat view
    of ``rows.nbytes // block_size`` rows; ``roots`` the engine's roots in
    list order and ``placement`` where a key lives among them. Built by
    ``block.spec.build_step`` in I/O threads and worker processes alike."""

    def __init__(
        self,
        roots: Sequence[StepRoot],
        rows: memoryview,
        placement: RootPlacement,
        pause: PausePoints | None = None,
    ):
        self.roots = tuple(roots)
        self.block_size = self.roots[0].blockio.options.block_size
        self.num_chunks = rows.nbytes // self.block_size
        self._rows = rows
        self._placement = placement
        self._pause = pause
        # Whole slices in one call without the GIL where it can (bytes_c.py).
        self._compiled = compiled_slices(self.roots, rows, placement, pause)

    def run(
        self, is_load: bool, key: bytes, chunk: int, still_wanted: Callable[[], bool]
    ) -> BlockResult:
        """Move one block; its result (an Outcome, or a Failed naming why)."""
        if self._pause is not None:  # tests: before every check, so a held block re-checks
            self._pause.reached("enter", "load" if is_load else "store", key)
        if not still_wanted():
            return DEADLINE
        if not 0 <= chunk < self.num_chunks:
            message = f"chunk {chunk} outside the primary buffer (0..{self.num_chunks - 1})"
            return failed(IndexError(message))
        start = chunk * self.block_size
        row = self._rows[start : start + self.block_size]
        try:
            if is_load:
                return self._load(key, row)
            return self._store(key, row, still_wanted)
        except Exception as exc:  # recorded per block; never ends a thread or worker
            return failed(without_tracebacks(exc))
        finally:
            try:
                row.release()
            except BufferError:  # a view still exported: freed with it
                pass

    def run_slice(
        self,
        is_load: bool,
        keys: Sequence[bytes],
        chunks: Sequence[int],
        still_wanted: Callable[[], bool],
        deadline: float | None = None,
    ) -> list[BlockResult]:
        """``run`` for consecutive blocks of one job, in order. After a load
        fails the rest are SKIPPED without I/O: vLLM can use only the blocks
        before the first failure (the scheduler stops the job's other blocks
        the same way). ``deadline``: the ``time.monotonic()`` time after
        which ``still_wanted`` may turn false (inf: never; None: not known,
        so only ``still_wanted`` can tell); given, the compiled byte path
        runs the slice where it can (bytes_c.py). Never raises."""
        if self._compiled is not None and deadline is not None:
            return self._compiled.run_slice(self, is_load, keys, chunks, still_wanted, deadline)
        results: list[BlockResult] = []
        for key, chunk in zip(keys, chunks):
            result = self.run(is_load, key, chunk, still_wanted)
            results.append(result)
            if is_load and not isinstance(result, Outcome):
                results += [SKIPPED] * (len(keys) - len(results))
                break
        return results

    def _load(self, key: bytes, row: memoryview) -> BlockResult:
        """From the block's home root, else its second choice (where it was
        written before the home root was added); a lost root is skipped."""
        first_error: BlockNotMoved | None = None
        for index in self._placement.choices(key):
            blockio, signals = self.roots[index]
            if signals.root_lost:
                first_error = first_error or VolumeFailed(blockio.layout.root_dir)
                continue
            if self._pause is not None:  # tests: a read the volume has not answered yet
                self._pause.reached("read", "load", key)
            try:
                return blockio.load(key, row)
            except BlockMissing as exc:
                first_error = first_error or exc
            except RootGone as exc:  # lost since the last housekeeping check
                lost = VolumeFailed(blockio.layout.root_dir)
                lost.__cause__ = exc
                first_error = first_error or lost
        assert first_error is not None
        raise first_error

    def _store(self, key: bytes, row: memoryview, still_wanted: Callable[[], bool]) -> BlockResult:
        blockio, signals = self.roots[self._placement.home(key)]
        if signals.root_lost:
            raise VolumeFailed(blockio.layout.root_dir)
        if signals.stores_refused:
            raise StoreRefused(signals.refusal)
        if self._pause is not None:
            still_wanted = self._pausing_before_publish(self._pause, key, still_wanted)
        try:
            return blockio.store(key, row, still_wanted)
        except RootGone as exc:
            raise VolumeFailed(blockio.layout.root_dir) from exc
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                trip_on_enospc(signals, blockio.layout.root_dir)
            raise

    @staticmethod
    def _pausing_before_publish(
        pause: PausePoints, key: bytes, still_wanted: Callable[[], bool]
    ) -> Callable[[], bool]:
        def publish_point() -> bool:  # BlockIO.store asks this right before its rename
            pause.reached("publish", "store", key)
            return still_wanted()

        return publish_point
