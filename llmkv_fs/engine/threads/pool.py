"""Two-priority I/O thread pool that spreads every job's blocks over threads.

Read-priority threads take load blocks first and store blocks when no load
is waiting; write-priority threads do the reverse. A job's blocks spread over
all idle threads, so one large promotion uses the whole pool instead of one
thread (vLLM's built-in runs a job on a single thread).

Threading rules
---------------
* ``submit``, ``take_finished``, ``queued_store_blocks`` are called by the
  owner (the scheduler side, under vLLM's manager lock). They never block on
  I/O: they take the pool's condition lock only to append or pop.
* Worker threads run ``execute(job, index)`` with no lock held, write the
  block's outcome into ``job.outcomes[index]`` (each index has exactly one
  writer) and append the job to the finished deque after its last block.
* ``drain`` and ``shutdown`` block the caller; they are for reset and exit.

A failed load block ends its job
--------------------------------
vLLM can use only the blocks of a load job before the first one that failed,
in key order (its built-in fs tier stops reading there). So when a load block
fails, the job's blocks no thread has taken yet are not read: they finish at
once as SKIPPED. Blocks already in flight on other threads run to the end
(a read cannot be cut short); the owner decides from the outcomes, in key
order, which of them count as loaded (engine.py).

Deadlines
---------
``expire_overdue`` (owner side) fails a job that has passed its deadline:
its queued blocks are dropped at once. Blocks already inside a syscall
cannot be interrupted. A store job is reported right away anyway -- its
in-flight writes are told not to publish (``IoJob.still_wanted``). A load
job is reported only when its in-flight reads return, since the kernel may
still write into a row that vLLM would reuse once the job is reported.
Blocks still running for an expired job are "stuck"; while any is, the
volume is stalled (``stuck_blocks``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from llmkv_fs.engine.scheduling.jobs import IoJob, JobReports, QueueFull
from llmkv_fs.engine.volume.numa import pin_current_thread
from llmkv_fs.engine.outcomes import CANCELLED, DEADLINE, SKIPPED, BlockResult, Failed, failed

__all__ = ["IoJob", "IoPool", "JobReports", "QueueFull"]

logger = logging.getLogger("vllm.llmkv_fs.pool")

_E = TypeVar("_E", bound=BaseException)


def _without_tracebacks(exc: _E) -> _E:
    """Drop the frames an exception holds: they reference the primary-buffer
    row being copied, and an idle worker keeping that alive stops vLLM from
    unmapping the region at shutdown."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


class IoPool(JobReports):
    def __init__(
        self,
        execute: Callable[[IoJob, int], BlockResult],
        n_read_threads: int,
        n_write_threads: int,
        max_queued_store_blocks: int,
        pin_cpus: frozenset[int] | None = None,
        name: str = "llmkv_fs",
    ):
        self._execute = execute
        self._max_queued_stores = max_queued_store_blocks
        self._pin_cpus = pin_cpus
        self._cond = threading.Condition(threading.Lock())
        # Jobs with blocks no thread has taken yet; a thread takes the head
        # job's next block (no per-block objects on the submit path).
        self._loads: collections.deque[IoJob] = collections.deque()
        self._stores: collections.deque[IoJob] = collections.deque()
        self._queued_blocks = {True: 0, False: 0}  # by is_load
        self._finished: collections.deque[IoJob] = collections.deque()
        self._unfinished_jobs = 0
        # Jobs with a deadline, in submission order (hence deadline order:
        # one timeout for all), until reported.
        self._watched: collections.deque[IoJob] = collections.deque()
        self._stuck = 0
        self._busy_threads = 0
        self._stopping = False
        self._threads = [
            threading.Thread(
                target=self._worker,
                args=(load_first,),
                daemon=True,
                name=f"{name}_{'r' if load_first else 'w'}{i}",
            )
            for load_first, count in ((True, n_read_threads), (False, n_write_threads))
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    # -- owner side --------------------------------------------------------------

    def submit(self, job: IoJob) -> None:
        """Queue every block of ``job``. Raises QueueFull (nothing queued)
        for a store job that does not fit, and RuntimeError after shutdown."""
        n = len(job.keys)
        with self._cond:
            if self._stopping:
                raise RuntimeError("llmkv_fs I/O pool is shut down")
            if not n:  # nothing to move: done now, or it would never finish
                job.reported = True
                self._finished.append(job)
                return
            queued = self._queued_blocks[job.is_load]
            # A store job bigger than the bound alone still gets an empty
            # queue, or a long prompt could never be stored at all.
            if not job.is_load and queued and queued + n > self._max_queued_stores:
                raise QueueFull(job.job_id)
            (self._loads if job.is_load else self._stores).append(job)
            self._queued_blocks[job.is_load] = queued + n
            self._unfinished_jobs += 1
            if job.deadline is not None:
                self._watched.append(job)
            self._cond.notify(n)

    def queued_store_blocks(self) -> int:
        return self._queued_blocks[False]

    def queued_load_blocks(self) -> int:
        return self._queued_blocks[True]

    def busy_threads(self) -> int:
        return self._busy_threads

    # The same questions ProcPool answers about its worker processes.
    workers_died = 0

    def worker_pids(self) -> list[int]:
        return []

    def max_in_flight(self) -> int:
        """Blocks the threads can hold at once (any thread takes either direction)."""
        return len(self._threads)

    def _expire(self, job: IoJob) -> int:
        with self._cond:
            queued = self._unqueue(job)
            with job._lock:
                job.expired = True
                in_flight = job.running
                self._stuck += in_flight
                # A store is reported now: its in-flight writes won't publish.
                report = job._fail(queued, DEADLINE, all_unfinished=not job.is_load)
        if report:
            self._publish(job)
        return len(queued) + (0 if job.is_load else in_flight)

    def _unqueue(self, job: IoJob) -> range:
        """Take ``job``'s untaken blocks off the queue (pool lock held)."""
        queued = range(job.next_block, len(job.keys))
        if queued:
            (self._loads if job.is_load else self._stores).remove(job)
            self._queued_blocks[job.is_load] -= len(queued)
            job.next_block = len(job.keys)
        return queued

    def busy(self) -> bool:
        return self._unfinished_jobs > 0 or bool(self._finished)

    def drain(self) -> None:
        """Block until every submitted job has finished (results stay
        queued for take_finished). In-flight copies are never cut short."""
        with self._cond:
            self._cond.wait_for(lambda: self._unfinished_jobs == 0)

    def shutdown(self) -> None:
        """Cancel queued blocks (their jobs finish as failed), let running
        blocks complete, and join the threads."""
        with self._cond:
            self._stopping = True
            cancelled = [(job, self._unqueue(job)) for job in [*self._loads, *self._stores]]
            self._cond.notify_all()
        for job, indices in cancelled:
            with job._lock:
                report = job._fail(indices, CANCELLED)
            if report:
                self._publish(job)
        for thread in self._threads:
            thread.join()

    # -- worker side -------------------------------------------------------------

    def _worker(self, load_first: bool) -> None:
        pin_current_thread(self._pin_cpus)
        first, second = (self._loads, self._stores) if load_first else (self._stores, self._loads)
        while True:
            with self._cond:
                while not (first or second or self._stopping):
                    self._cond.wait()
                if self._stopping and not (first or second):
                    return
                queue = first if first else second
                job = queue[0]
                index = job.next_block
                job.next_block = index + 1
                if job.next_block == len(job.keys):
                    queue.popleft()
                self._queued_blocks[job.is_load] -= 1
                self._busy_threads += 1
                # Counted under the pool lock, so _expire sees every block
                # that left the queue as in flight.
                with job._lock:
                    job.running += 1
                    if job.first_start is None:
                        job.first_start = time.monotonic()
            outcome: BlockResult
            try:
                outcome = self._execute(job, index)
            except Exception as exc:  # recorded per block; never kills the thread
                outcome = failed(_without_tracebacks(exc))
            if job.is_load and isinstance(outcome, Failed):
                self._skip_rest(job)
            finishes, was_stuck = job._block_done(index, outcome)
            with self._cond:
                self._busy_threads -= 1
                if was_stuck:
                    self._stuck -= 1
            if finishes:
                self._publish(job)
            del job, outcome

    def _skip_rest(self, job: IoJob) -> None:
        """A load block failed: the blocks of ``job`` no thread has taken
        (all after the failed one: blocks are taken in key order) finish as
        SKIPPED, unread. The caller's own block is still counted as running,
        so this never reports the job."""
        with self._cond:
            skipped = self._unqueue(job)
            if skipped:
                with job._lock:
                    job._fail(skipped, SKIPPED)

    def _publish(self, job: IoJob) -> None:
        self._finished.append(job)
        with self._cond:
            self._unfinished_jobs -= 1
            if self._unfinished_jobs == 0:
                self._cond.notify_all()
