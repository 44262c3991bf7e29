"""Two-priority I/O thread pool that splits every job into per-block tasks.

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
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmkv_fs.engine.numa import pin_current_thread

__all__ = ["CANCELLED", "IoJob", "IoPool", "QueueFull"]

logger = logging.getLogger("vllm.llmkv_fs.pool")

CANCELLED = "cancelled"  # outcome of a block that never started (shutdown)


class QueueFull(Exception):
    """A store job would push the store queue past its bound."""


class IoJob:
    """One submitted job. ``keys[i]`` goes to/from primary chunk ``chunks[i]``.

    ``outcomes[i]`` is None until block i finishes, then an Outcome or an
    exception instance. ``first_start``/``last_end`` bound the I/O time.
    """

    __slots__ = (
        "job_id", "is_load", "keys", "chunks", "outcomes", "_left", "_lock",
        "submitted", "first_start", "last_end",
    )

    def __init__(self, job_id: int, is_load: bool, keys: Sequence[bytes], chunks: Sequence[int]):
        self.job_id = job_id
        self.is_load = is_load
        self.keys = keys
        self.chunks = chunks
        self.outcomes: list[Any] = [None] * len(keys)
        self._left = len(keys)
        self._lock = threading.Lock()
        self.submitted = time.monotonic()
        self.first_start: float | None = None
        self.last_end = 0.0

    def _block_done(self, index: int, outcome: Any, started: float) -> bool:
        """Record one block; True for the call that finished the job."""
        self.outcomes[index] = outcome
        with self._lock:
            if self.first_start is None or started < self.first_start:
                self.first_start = started
            self.last_end = time.monotonic()
            self._left -= 1
            return self._left == 0

    @property
    def io_seconds(self) -> float:
        return self.last_end - self.first_start if self.first_start is not None else 0.0


def _without_tracebacks(exc: BaseException) -> BaseException:
    """Drop the frames an exception holds: they reference the primary-buffer
    row being copied, and an idle worker keeping that alive stops vLLM from
    unmapping the region at shutdown."""
    seen = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


class IoPool:
    def __init__(
        self,
        execute: Callable[[IoJob, int], Any],
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
        self._loads: collections.deque[tuple[IoJob, int]] = collections.deque()
        self._stores: collections.deque[tuple[IoJob, int]] = collections.deque()
        self._finished: collections.deque[IoJob] = collections.deque()
        self._unfinished_jobs = 0
        self._stopping = False
        self._threads = [
            threading.Thread(
                target=self._worker, args=(load_first,), daemon=True,
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
        tasks = [(job, i) for i in range(len(job.keys))]
        with self._cond:
            if self._stopping:
                raise RuntimeError("llmkv_fs I/O pool is shut down")
            if not tasks:  # nothing to move: done now, or it would never finish
                self._finished.append(job)
                return
            if job.is_load:
                self._loads.extend(tasks)
            else:
                # A job bigger than the bound alone still gets an empty queue,
                # or a long prompt could never be stored at all.
                if self._stores and len(self._stores) + len(tasks) > self._max_queued_stores:
                    raise QueueFull(job.job_id)
                self._stores.extend(tasks)
            self._unfinished_jobs += 1
            self._cond.notify(len(tasks))

    def take_finished(self) -> list[IoJob]:
        # The deque is appended by workers and popped only here: popleft is
        # atomic, so no lock is needed.
        finished = []
        while self._finished:
            finished.append(self._finished.popleft())
        return finished

    def queued_store_blocks(self) -> int:
        return len(self._stores)

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
            cancelled = list(self._loads) + list(self._stores)
            self._loads.clear()
            self._stores.clear()
            self._cond.notify_all()
        now = time.monotonic()
        for job, index in cancelled:
            self._complete(job, index, CANCELLED, now)
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
                job, index = first.popleft() if first else second.popleft()
            started = time.monotonic()
            try:
                outcome = self._execute(job, index)
            except Exception as exc:  # recorded per block; never kills the thread
                outcome = _without_tracebacks(exc)
            self._complete(job, index, outcome, started)
            del job, outcome

    def _complete(self, job: IoJob, index: int, outcome: Any, started: float) -> None:
        if job._block_done(index, outcome, started):
            self._finished.append(job)
            with self._cond:
                self._unfinished_jobs -= 1
                if self._unfinished_jobs == 0:
                    self._cond.notify_all()
