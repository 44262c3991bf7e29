"""The block scheduler: one implementation of everything about jobs, whatever
runs their blocks -- the queues and read priority, handing out blocks,
deadlines and expiry, the load prefix rule, cancellation at shutdown, and
reporting finished jobs to the owner. An executor (scheduling/executor.py)
takes blocks and gives them back with results; it decides nothing else.

Read priority: an executor place asks for loads first or stores first
(``take(load_first)``); a job's blocks spread over every place that asks, so
one large promotion uses the whole executor (vLLM's built-in runs a job on
one thread).

Slices: a place takes several consecutive blocks of one job at once (a
``BlockSlice``) when there is enough work queued for every place to get as
many twice over -- one lock round trip, one pipe record to a worker, one
give-back for all of them -- never more than ``slice_blocks`` (set by the engine from the
block size: a small block costs more besides its bytes than in them,
docs/benchmarks.md, "Small blocks"). A lone job still spreads one block per
place.

A failed load block ends its job: vLLM can use only the blocks of a load job
before the first one that failed, in key order (its built-in stops reading
there). So when a load block fails, the job's blocks not handed out yet are
not read: they finish at once as SKIPPED. Blocks already out run to the end;
the owner decides from the outcomes, in key order, which of them count
(accounting.loaded_prefix).

Deadlines: ``expire_overdue`` (owner) fails a job past its deadline: its
queued blocks are dropped at once. Blocks already out cannot be interrupted.
A store job is reported right away anyway -- the executor is told
(``job_expired``) and its blocks see ``still_wanted()`` false, so they never
publish. A load job is reported only when its blocks are back, since the
kernel may still write into a row that vLLM would reuse once the job is
reported. Blocks still out for an expired job are "stuck"; while any is, the
volume is stalled (``stuck_blocks``).

Threading rules
---------------
* Owner (vLLM's scheduler side, one thread at a time): ``submit``,
  ``take_finished``, ``has_news``, ``expire_overdue``, the gauges. ``submit``
  takes no lock -- it appends to ``_incoming`` and bumps counters only it
  writes -- because a lock shared with the executor's threads makes the
  owner wait for GIL hand-offs (docs/benchmarks.md, "Figures behind the
  code").
* Executor threads: ``take`` and ``slice_done``, each one short hold of the
  scheduler lock.
* One lock, never held across I/O, a syscall or a call into the executor.
* ``drain`` and ``shutdown`` block the caller; they are for reset and exit.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from llmkv_fs.engine.outcomes import CANCELLED, DEADLINE, SKIPPED, BlockResult, Failed
from llmkv_fs.engine.scheduling.executor import Executor
from llmkv_fs.engine.scheduling.jobs import BlockSlice, IoJob, QueueFull

__all__ = ["BlockScheduler"]


class BlockScheduler:
    """See the module doc. ``start(executor)`` once, ``shutdown()`` once."""

    def __init__(self, max_queued_store_blocks: int, slice_blocks: int = 1):
        self._max_queued_stores = max_queued_store_blocks
        self._slice_blocks = max(1, slice_blocks)
        self._places = 1  # the executor's capacity, once started
        self._lock = threading.Lock()
        self._all_done = threading.Condition(self._lock)
        self._executor: Executor | None = None
        # Jobs with blocks not handed out yet: submitted (owner, no lock) ...
        self._incoming: collections.deque[IoJob] = collections.deque()
        # ... then admitted onto the priority queues under the lock.
        self._loads: collections.deque[IoJob] = collections.deque()
        self._stores: collections.deque[IoJob] = collections.deque()
        # Queued blocks and unfinished jobs as differences of counters with
        # one writer each: "in" by the owner's submit, "out" under the lock.
        # A read may be a moment stale; the store bound is a bound.
        self._blocks_in = {True: 0, False: 0}  # by is_load
        self._blocks_out = {True: 0, False: 0}
        self._jobs_in = 0
        self._jobs_out = 0
        self._in_flight = 0  # blocks handed out, not back yet
        self._slices_out = 0  # slices handed out: one per busy place
        self._stuck = 0  # of those, blocks of expired jobs
        self._finished: collections.deque[IoJob] = collections.deque()
        # Jobs with a deadline in submission order (hence deadline order:
        # one timeout for all), until reported.
        self._watched: collections.deque[IoJob] = collections.deque()
        self._stopping = False

    def start(self, executor: Executor) -> None:
        """Hand blocks to ``executor`` from now on (raises what its start raises)."""
        self._executor = executor
        self._places = max(1, executor.capacity())
        executor.start(self)

    @property
    def executor(self) -> Executor:
        assert self._executor is not None, "start() first"
        return self._executor

    # -- owner side ------------------------------------------------------------

    def submit(self, job: IoJob) -> None:
        """Queue every block of ``job``. Raises QueueFull (nothing queued)
        for a store job that does not fit, and RuntimeError after shutdown."""
        n = len(job.keys)
        if self._stopping:
            raise RuntimeError("llmkv_fs I/O scheduler is shut down")
        if not n:  # nothing to move: done now, or it would never finish
            job.reported = True
            self._finished.append(job)
            return
        if not job.is_load:
            queued = self.queued_store_blocks()
            # A store job bigger than the bound alone still gets an empty
            # queue, or a long prompt could never be stored at all.
            if queued and queued + n > self._max_queued_stores:
                raise QueueFull(job.job_id)
        self._blocks_in[job.is_load] += n
        self._jobs_in += 1
        if job.deadline is not None:
            self._watched.append(job)
        self._incoming.append(job)
        self.executor.work_arrived(n)

    def queued_store_blocks(self) -> int:
        return self._blocks_in[False] - self._blocks_out[False]

    def queued_load_blocks(self) -> int:
        return self._blocks_in[True] - self._blocks_out[True]

    def blocks_in_flight(self) -> int:
        """Blocks handed to the executor and not given back yet (a place
        holds a whole slice: up to ``slice_blocks`` of them)."""
        return self._in_flight

    def busy_places(self) -> int:
        """Executor places holding a slice: never more than ``places``."""
        return self._slices_out

    @property
    def places(self) -> int:
        """Slices the executor can hold at once (its ``capacity()``): an
        I/O thread is one place, a worker process DEPTH."""
        return self._places

    def stuck_blocks(self) -> int:
        """Blocks still out although their job's deadline passed: nonzero
        means the volume is not answering."""
        return self._stuck

    def busy(self) -> bool:
        return self._jobs_in > self._jobs_out or bool(self._finished)

    def has_news(self) -> bool:
        """Something for take_finished or expire_overdue to do (cheap: vLLM
        polls every millisecond)."""
        if self._finished:
            return True
        if not self._watched:
            return False
        head = self._watched[0]
        return head.reported or (head.deadline is not None and head.deadline <= time.monotonic())

    def take_finished(self) -> list[IoJob]:
        # Appended by executor threads, popped only here: popleft is atomic.
        finished = []
        while self._finished:
            finished.append(self._finished.popleft())
        return finished

    def expire_overdue(self, now: float | None = None) -> int:
        """Fail every job past its deadline (see the module doc). Returns the
        number of blocks failed by it. Never blocks on I/O."""
        now = time.monotonic() if now is None else now
        failed = 0
        while self._watched:
            job = self._watched[0]
            if job.reported:
                self._watched.popleft()
                continue
            if job.deadline is None or job.deadline > now:
                break
            self._watched.popleft()
            failed += self._expire(job)
        return failed

    def _expire(self, job: IoJob) -> int:
        with self._lock:
            queued = self._unqueue(job)
            job.expired = True
            out = job.running
            self._stuck += out
            if job.is_load:  # reported when its blocks out are back
                self._fail(job, queued, DEADLINE)
            else:  # reported now: its blocks still out won't publish
                self._fail(job, [i for i, o in enumerate(job.outcomes) if o is None], DEADLINE)
        if out:
            self.executor.job_expired(job)
        return len(queued) + (0 if job.is_load else out)

    def drain(self) -> None:
        """Block until every submitted job has finished (results stay queued
        for take_finished). Blocks out are never cut short."""
        with self._all_done:
            self._all_done.wait_for(lambda: self._jobs_in == self._jobs_out)

    def shutdown(self) -> None:
        """Fail every queued block as CANCELLED, stop the executor (it gives
        back or fails what it holds) and return when it is gone."""
        with self._lock:
            self._stopping = True
            for job in [*self._incoming, *self._loads, *self._stores]:
                self._fail(job, self._unqueue(job), CANCELLED)
        if self._executor is not None:
            self._executor.stop()

    # -- executor side (BlockSource) -------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    def take(self, load_first: bool) -> BlockSlice | None:
        """The next blocks to run: a slice of the head job of the preferred
        queue (loads first when ``load_first``), or None when none is queued."""
        with self._lock:
            while self._incoming:
                job = self._incoming.popleft()
                (self._loads if job.is_load else self._stores).append(job)
            queue = (self._loads or self._stores) if load_first else (self._stores or self._loads)
            if not queue:
                return None
            job = queue[0]
            is_load = job.is_load
            first = job.next_block
            left = len(job.keys) - first
            count = 1
            if self._slice_blocks > 1 and left > 1:
                # Enough queued for every place to take this many twice over
                # (or the cap); less work spreads one block per place.
                queued = self._blocks_in[is_load] - self._blocks_out[is_load]
                count = min(left, self._slice_blocks, max(1, queued // (2 * self._places)))
            job.next_block = first + count
            if job.next_block == len(job.keys):
                queue.popleft()
            self._blocks_out[is_load] += count
            self._in_flight += count
            self._slices_out += 1
            job.running += count
            if job.first_start is None:
                job.first_start = time.monotonic()
            return BlockSlice(job, first, count)

    def slice_done(self, taken: BlockSlice, results: Sequence[BlockResult]) -> None:
        """Give a taken slice back with each block's result, in order."""
        job = taken.job
        if len(results) != taken.n_blocks:
            raise ValueError(f"{len(results)} results for a slice of {taken.n_blocks} blocks")
        with self._lock:
            job.running -= taken.n_blocks
            self._in_flight -= taken.n_blocks
            self._slices_out -= 1
            if job.expired:
                self._stuck -= taken.n_blocks
            if job.reported:
                return  # a store failed by its deadline without these blocks
            # A read that did complete after the deadline is as good as ever.
            job.outcomes[taken.first : taken.first + taken.n_blocks] = results
            job.last_end = time.monotonic()
            job.left -= taken.n_blocks
            if (
                job.is_load
                and job.next_block < len(job.keys)
                and any(isinstance(result, Failed) for result in results)
            ):
                self._fail(job, self._unqueue(job), SKIPPED)  # publishes if it was the last
            elif job.left == 0:
                self._publish(job)

    # -- under the lock --------------------------------------------------------

    def _unqueue(self, job: IoJob) -> range:
        """Take ``job``'s blocks not handed out yet off the queues."""
        queued = range(job.next_block, len(job.keys))
        if queued:
            if job.next_block or not _remove(self._incoming, job):
                _remove(self._loads if job.is_load else self._stores, job)
            self._blocks_out[job.is_load] += len(queued)
            job.next_block = len(job.keys)
        return queued

    def _fail(self, job: IoJob, indices: Sequence[int], outcome: Failed) -> None:
        """Fail blocks that will not run; report the job if nothing is left."""
        for index in indices:
            job.outcomes[index] = outcome
        job.left -= len(indices)
        now = time.monotonic()
        if job.first_start is None:
            job.first_start = now
        job.last_end = max(job.last_end, now)
        if job.left == 0 and not job.reported:
            self._publish(job)

    def _publish(self, job: IoJob) -> None:
        job.reported = True
        self._finished.append(job)
        self._jobs_out += 1
        if self._jobs_out == self._jobs_in:
            self._all_done.notify_all()


def _remove(queue: collections.deque[IoJob], job: IoJob) -> bool:
    try:
        queue.remove(job)
        return True
    except ValueError:
        return False
