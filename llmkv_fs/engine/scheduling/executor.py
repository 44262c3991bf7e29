"""What the block scheduler needs of whatever runs blocks: the two sides of
one small protocol.

``BlockSource`` is the scheduler as an executor sees it: take the next
blocks (a slice of one job; read priority or write priority), give them
back with their results. ``Executor``
is what the scheduler drives: started once, woken when work arrives, told
when a job passes its deadline while some of its blocks are out, stopped
once. I/O threads (threads/thread_executor.py) and worker processes
(workers/process_executor.py) implement it; a third way to move bytes implements
these methods and touches nothing in the scheduler.

Threading: ``work_arrived`` and ``job_expired`` are called on the owner's
thread (vLLM's scheduler side) and must not wait on I/O or on the executor's
own threads; ``stop`` blocks until every block the executor took is given
back and its threads and processes are gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from llmkv_fs.engine.outcomes import BlockResult
from llmkv_fs.engine.scheduling.jobs import BlockSlice, IoJob

__all__ = ["BlockSource", "Executor"]


class BlockSource(Protocol):
    def take(self, load_first: bool) -> BlockSlice | None:
        """The next blocks to run, consecutive blocks of one job (loads first
        when ``load_first``, else stores first), or None when nothing is
        queued."""
        ...

    def slice_done(self, taken: BlockSlice, results: Sequence[BlockResult]) -> None:
        """Give a taken slice back with each block's result, in order;
        exactly once per slice."""
        ...

    @property
    def stopping(self) -> bool:
        """True once the scheduler shuts down: no block will be handed out."""
        ...


class Executor(Protocol):
    def start(self, source: BlockSource) -> None:
        """Begin taking blocks from ``source``. Raises OSError/RuntimeError
        if the executor cannot run at all (nothing is then left running)."""
        ...

    def work_arrived(self, blocks: int) -> None:
        """``blocks`` blocks were queued (owner thread; cheap, never waits)."""
        ...

    def job_expired(self, job: IoJob) -> None:
        """``job`` passed its deadline while blocks of it may be out: tell
        them, so that a store is never published (owner thread; cheap)."""
        ...

    def stop(self) -> None:
        """Called after the scheduler stopped handing out blocks: wait for the
        blocks taken (within the executor's own grace), then end every thread
        and process. Blocks it gives up on are given back failed."""
        ...

    def capacity(self) -> int:
        """Its places: slices (of one or more blocks) it can hold at once,
        running or waiting in it -- an I/O thread is one place, a worker
        process two. The ``busy_places`` gauge counts those in use."""
        ...

    def worker_pids(self) -> list[int]:
        """Its live worker processes (none for threads)."""
        ...

    def deaths(self) -> int:
        """Worker processes that died and were replaced, cumulative (0 for
        threads, which do not die: a block's exception is its result)."""
        ...
