"""The I/O-thread executor: threads of the engine's own process take blocks
from the scheduler and run each through the one per-block function
(block/blockio.py).

Read-priority threads ask for loads first, write-priority threads for stores
first (scheduling/scheduler.py decides what that means). While blocks are
queued a thread touches nothing but the scheduler: it takes the next block
right after giving one back. Only when ``take`` finds nothing does it take
the executor's condition, ask once more and sleep; ``work_arrived`` notifies
under the same condition after the blocks were queued, so a wake-up is never
lost. (No semaphore taken once per block: Python code under the GIL per
block costs the thread mode much of its throughput; docs/benchmarks.md,
"Figures behind the code".)

Threading: ``start``, ``work_arrived``, ``job_expired`` and ``stop`` are the
scheduler's calls (owner thread); the I/O threads run ``_serve`` and touch
nothing but the scheduler, the BlockStep and the rows of their blocks. A
block's exception is its result (BlockStep.run never raises), so a thread
never dies of one.
"""

from __future__ import annotations

import math
import threading

from llmkv_fs.engine.block.blockio import BlockStep
from llmkv_fs.engine.scheduling.scheduler import BlockSlice, BlockSource, IoJob
from llmkv_fs.engine.startup.numa import pin_current_thread

__all__ = ["ThreadExecutor"]


class ThreadExecutor:
    """Implements scheduling.scheduler.Executor with I/O threads."""

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
        self.n_read_threads, self.n_write_threads = n_read_threads, n_write_threads
        self._idle = threading.Condition(threading.Lock())
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
        with self._idle:
            self._idle.notify(blocks)

    def job_expired(self, job: IoJob) -> None:
        """Nothing to do: a thread's block reads ``job.cancelled``."""

    def stop(self) -> None:
        with self._idle:  # the scheduler is stopping: every sleeper must see it
            self._idle.notify_all()
        for thread in self._threads:
            if thread.ident is not None:
                thread.join()

    def capacity(self) -> int:
        """Any thread takes either direction: one slice each."""
        return len(self._threads)

    def worker_pids(self) -> list[int]:
        return []

    def deaths(self) -> int:
        return 0

    def _serve(self, load_first: bool) -> None:
        pin_current_thread(self._pin_cpus)
        source, step = self._source, self._step
        assert source is not None
        while True:
            taken = source.take(load_first) or self._wait_for_blocks(source, load_first)
            if taken is None:
                return  # stopping, nothing left to take
            job = taken.job
            # The job's deadline: the compiled byte path stops at it.
            deadline = math.inf if job.deadline is None else job.deadline
            results = step.run_slice(job.is_load, taken.keys, taken.chunks, job.cancelled, deadline)
            source.slice_done(taken, results)
            # Drop the references before sleeping: an idle thread must not
            # keep a job (and through it the primary rows) alive.
            del taken, job, results

    def _wait_for_blocks(self, source: BlockSource, load_first: bool) -> BlockSlice | None:
        """Sleep until blocks can be taken (None: the scheduler stops)."""
        with self._idle:
            while True:
                taken = source.take(load_first)
                if taken is not None or source.stopping:
                    return taken
                self._idle.wait()
