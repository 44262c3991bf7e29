"""The I/O-thread executor: threads of the engine's own process take blocks
from the scheduler and run each through the one per-block function
(block/step.py).

Read-priority threads ask for loads first, write-priority threads for stores
first (scheduling/scheduler.py decides what that means). A thread sleeps on
a semaphore with one permit per queued block: a permit is never lost, and
one for a block the scheduler dropped meanwhile (skipped, expired) costs one
empty ``take``.

Threading: ``start``, ``work_arrived``, ``job_expired`` and ``stop`` are the
scheduler's calls (owner thread); the I/O threads run ``_serve`` and touch
nothing but the scheduler, the BlockStep and the rows of their blocks. A
block's exception is its result (BlockStep.run never raises), so a thread
never dies of one.
"""

from __future__ import annotations

import threading

from llmkv_fs.engine.block.step import BlockStep
from llmkv_fs.engine.scheduling.executor import BlockSource
from llmkv_fs.engine.scheduling.jobs import IoJob
from llmkv_fs.engine.volume.numa import pin_current_thread

__all__ = ["ThreadExecutor"]


class ThreadExecutor:
    """Implements scheduling.executor.Executor with I/O threads."""

    def __init__(
        self,
        step: BlockStep,
        n_read_threads: int,
        n_write_threads: int,
        pin_cpus: frozenset[int] | None = None,
        name: str = "llmkv_fs",
    ):
        self._step = step
        self._pin_cpus = pin_cpus
        self._permits = threading.Semaphore(0)
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=(load_first,),
                daemon=True,
                name=f"{name}_{'r' if load_first else 'w'}{i}",
            )
            for load_first, count in ((True, n_read_threads), (False, n_write_threads))
            for i in range(count)
        ]
        self._source: BlockSource | None = None

    def start(self, source: BlockSource) -> None:
        self._source = source
        for thread in self._threads:
            thread.start()

    def work_arrived(self, blocks: int) -> None:
        self._permits.release(blocks)

    def job_expired(self, job: IoJob) -> None:
        """Nothing to do: a thread's block asks ``job.still_wanted()``."""

    def stop(self) -> None:
        self._permits.release(len(self._threads))  # one each, to see stopping
        for thread in self._threads:
            if thread.ident is not None:
                thread.join()

    def capacity(self) -> int:
        """Any thread takes either direction: one block each."""
        return len(self._threads)

    def worker_pids(self) -> list[int]:
        return []

    def deaths(self) -> int:
        return 0

    def _serve(self, load_first: bool) -> None:
        pin_current_thread(self._pin_cpus)
        source, step, permits = self._source, self._step, self._permits
        assert source is not None
        while True:
            permits.acquire()
            ticket = source.take(load_first)
            if ticket is None:
                if source.stopping:
                    return
                continue
            job = ticket.job
            result = step.run(job.is_load, ticket.key, ticket.chunk, job.still_wanted)
            source.block_done(ticket, result)
            # Drop the references before sleeping: an idle thread must not
            # keep a job (and through it the primary rows) alive.
            del ticket, job, result
