"""The conductor thread of a ProcPool (procpool.py): the half of the pool
that moves records between the job queues and the worker processes.

Threading rules
---------------
* Every method here runs on the conductor thread, except the pool-lock
  bookkeeping at the end (``_unqueue``, ``_cancel_queued``, ``_publish``),
  which the owner calls too. The docstring says where the pool lock is held.
* It spawns, reaps and replaces every worker (workers.Crew), so
  PR_SET_PDEATHSIG ties the workers to the pool's life; it writes job
  records outside the pool lock and never blocks the owner.
* It never dies of an exception: a failure fails every job and stops the
  workers.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import selectors
import threading
import time
from collections.abc import Callable

from llmkv_fs.engine.outcomes import CANCELLED, SKIPPED, BlockResult, Failed, Failure, failed
from llmkv_fs.engine.threads.pool import IoJob, JobReports
from llmkv_fs.engine.workers.records import (
    JOB,
    OP_LOAD,
    OP_STORE,
    RESULT_HELLO,
    decode_result,
    take_results,
)
from llmkv_fs.engine.workers.crew import DEPTH, START_TIMEOUT_S, Crew, WorkerDied, WorkerHandle

__all__ = ["Conductor"]

logger = logging.getLogger("vllm.llmkv_fs.procpool")

# Blocks after a LOAD job's first failure that no worker took: not read
# (the same result pool.IoPool gives them).
NOT_LOADED = SKIPPED


class Conductor(JobReports):
    """The conductor's half of ProcPool, which sets every attribute below."""

    _admit_store: Callable[[], None]
    _note_error: Callable[[BaseException], None]
    _cond: threading.Condition
    _loads: collections.deque[IoJob]
    _stores: collections.deque[IoJob]
    _incoming: collections.deque[IoJob]
    _blocks_out: dict[bool, int]
    _jobs_in: int
    _jobs_out: int
    _conductor_idle: bool
    _stopping: bool
    _held_blocks: int
    _crew: Crew
    _board: mmap.mmap
    _wake: int
    _workers: list[WorkerHandle]
    _started: threading.Event
    _start_error: BaseException | None

    def _admit_incoming(self) -> None:
        """Move submitted jobs onto the priority queues (pool lock held)."""
        while self._incoming:
            job = self._incoming.popleft()
            (self._loads if job.is_load else self._stores).append(job)

    def _conduct(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake, selectors.EVENT_READ, None)
        try:
            for worker in self._workers:
                self._crew.spawn(worker, selector)
            self._await_hellos(selector)
        except BaseException as exc:  # reported to the constructor
            self._start_error = exc
            self._started.set()
            self._crew.stop(selector)
            return
        self._started.set()
        try:
            self._serve(selector)
        except BaseException:  # never dies silently: fail everything, stop
            logger.exception("llmkv_fs: the I/O conductor failed; stopping the worker pool")
            self._cancel_queued()
            for worker in self._workers:
                self._worker_gone(worker, selector, respawn=False)
        finally:
            self._crew.stop(selector)
            selector.close()

    def _serve(self, selector: selectors.BaseSelector) -> None:
        while True:
            with self._cond:
                self._admit_incoming()
                writes = self._dispatch()
                if self._stopping and self._held_blocks == 0:
                    return
            for fd, record in writes:  # outside the lock: a write releases the GIL
                with contextlib.suppress(OSError):  # a dead worker: its EOF fails them
                    os.write(fd, record)
            self._conductor_idle = True
            if self._incoming:  # submitted after the admit: no wake-up was sent
                self._conductor_idle = False
                continue
            events = selector.select()
            self._conductor_idle = False
            for key, _ in events:
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wake)
                else:
                    self._read_results(key.data, selector)

    def _await_hellos(self, selector: selectors.BaseSelector) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(w.ready for w in self._workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers not ready after {START_TIMEOUT_S:.0f}s")
            for key, _ in selector.select(left):
                if key.data is not None and not self._read_results(key.data, selector, start=True):
                    raise RuntimeError(f"worker {key.data.index} exited during start-up")

    def _dispatch(self) -> list[tuple[int, bytes]]:
        """Give every ready worker blocks up to DEPTH (pool lock held).
        Returns the records to write, after the lock is released."""
        writes: list[tuple[int, bytes]] = []
        for worker in self._workers:
            if not worker.ready:
                continue
            for slot, held in enumerate(worker.held):
                if held is not None:
                    continue
                first, second = (
                    (self._loads, self._stores)
                    if worker.load_first
                    else (self._stores, self._loads)
                )
                queue = first if first else second
                if not queue:
                    return writes
                job = queue[0]
                index = job.next_block
                job.next_block = index + 1
                if job.next_block == len(job.keys):
                    queue.popleft()
                self._blocks_out[job.is_load] += 1
                if not job.is_load:
                    try:
                        self._admit_store()
                    except Exception as exc:
                        self._finish_block(job, index, failed(exc))
                        continue
                with job._lock:
                    job.running += 1
                    if job.first_start is None:
                        job.first_start = time.monotonic()
                chunk = job.chunks[index]
                key = job.keys[index]
                board_slot = worker.index * DEPTH + slot
                self._board[board_slot] = 0
                worker.held[slot] = (job, index)
                self._held_blocks += 1
                op = OP_LOAD if job.is_load else OP_STORE
                writes.append((worker.jobs_w, JOB.pack(op, board_slot, chunk, len(key)) + key))
        return writes

    def _read_results(
        self, worker: WorkerHandle, selector: selectors.BaseSelector, start: bool = False
    ) -> bool:
        """Consume a worker's result records; False if it exited."""
        try:
            data = os.read(worker.results_r, 1 << 16)
        except OSError:
            data = b""
        if not data:
            self._worker_gone(worker, selector, respawn=not start)
            return False
        worker.buf += data
        done = []
        for slot, kind, extra, err, text in take_results(worker.buf):
            if kind == RESULT_HELLO:
                worker.ready = True
                continue
            done.append((slot - worker.index * DEPTH, decode_result(kind, extra, err, text)))
        if done:
            with self._cond:
                for slot, outcome in done:
                    held = worker.held[slot]
                    worker.held[slot] = None
                    self._held_blocks -= 1
                    if held is not None:
                        self._block_done(held[0], held[1], outcome)
        return True

    def _block_done(self, job: IoJob, index: int, outcome: BlockResult) -> None:
        """A block a worker held came back (pool lock held)."""
        if isinstance(outcome, Failed) and isinstance(outcome.error, OSError):
            self._note_error(outcome.error)
        with job._lock:
            job.running -= 1
            if job.expired or job.reported:
                self._stuck -= 1
            if job.reported:
                return
            self._record(job, index, outcome)

    def _finish_block(self, job: IoJob, index: int, outcome: BlockResult) -> None:
        """A block that never reached a worker (pool lock held)."""
        with job._lock:
            self._record(job, index, outcome)

    def _record(self, job: IoJob, index: int, outcome: BlockResult) -> None:
        """Store a block's result (job lock and pool lock held)."""
        job.outcomes[index] = outcome
        job.last_end = time.monotonic()
        job._left -= 1
        if job.is_load and isinstance(outcome, Failed) and job.next_block < len(job.keys):
            # Stop the load at its first failure: later blocks stay unread.
            rest = range(job.next_block, len(job.keys))
            self._loads.remove(job)
            self._blocks_out[True] += len(rest)
            job.next_block = len(job.keys)
            for later in rest:
                job.outcomes[later] = NOT_LOADED
            job._left -= len(rest)
        if job._claim_report():
            self._publish(job)

    def _worker_gone(
        self, worker: WorkerHandle, selector: selectors.BaseSelector, respawn: bool
    ) -> None:
        """Fail what the worker held, reap it, start a replacement."""
        lost, why = self._crew.reap(worker, selector, respawn and not self._stopping)
        with self._cond:
            for slot, (job, index) in lost:
                worker.held[slot] = None
                self._held_blocks -= 1
                self._block_done(job, index, Failed(Failure.ERROR, WorkerDied(why)))
            stopping = self._stopping
        if respawn and not stopping:
            self._crew.respawn(worker, selector)

    # -- pool-lock bookkeeping (either thread) ------------------------------------

    def _unqueue(self, job: IoJob) -> range:
        """Take ``job``'s untaken blocks off the queues (pool lock held)."""
        queued = range(job.next_block, len(job.keys))
        if queued:
            if job.next_block or not self._remove(self._incoming, job):
                self._remove(self._loads if job.is_load else self._stores, job)
            self._blocks_out[job.is_load] += len(queued)
            job.next_block = len(job.keys)
        return queued

    @staticmethod
    def _remove(queue: collections.deque[IoJob], job: IoJob) -> bool:
        try:
            queue.remove(job)
            return True
        except ValueError:
            return False

    def _cancel_queued(self) -> None:
        """Stop taking blocks; fail every queued one as CANCELLED."""
        with self._cond:
            self._stopping = True
            for job in [*self._incoming, *self._loads, *self._stores]:
                indices = self._unqueue(job)
                with job._lock:
                    if job._fail(indices, CANCELLED):
                        self._publish(job)

    def _publish(self, job: IoJob) -> None:
        self._finished.append(job)
        self._jobs_out += 1
        if self._jobs_out == self._jobs_in:
            self._cond.notify_all()
