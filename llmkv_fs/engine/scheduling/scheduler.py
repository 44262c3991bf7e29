"""Jobs and the block scheduler: one implementation of everything about jobs,
whatever runs their blocks -- the job itself (``IoJob``) and the blocks handed
out of it (``BlockSlice``), the queues and read priority, deadlines and
expiry, the load prefix rule, cancellation at shutdown, and reporting
finished jobs to the owner, accounted. An executor (``Executor``: I/O
threads, threads/thread_executor.py; worker processes,
workers/process_executor.py) takes blocks and gives them back with results;
it decides nothing else.

Read priority: an executor place asks for loads first or stores first
(``take(load_first)``); a job's blocks spread over every place that asks, so
one large promotion uses the whole executor (vLLM's built-in runs a job on
one thread).

Slices: a place takes several consecutive blocks of one job at once (a
``BlockSlice``) when there is enough work queued for every place to get as
many twice over -- one lock round trip, one pipe record to a worker, one
give-back for all of them -- never more than ``slice_blocks`` (set by the engine from the
block size: a small block costs more besides its bytes than in them,
docs/benchmarks.md, "Small blocks"). A lone job still spreads over the
places, in slices of ``least_slice_blocks`` (a slice's own cost is worth
that many blocks' bytes; 1: one block per place).

The load prefix rule: vLLM can use only the blocks of a load job before the
first one that failed, in key order (its built-in stops reading there). So
when a load block fails, the job's blocks not handed out yet are not read:
they finish at once as SKIPPED (``slice_done``; a slice's own later blocks
are not read either, block/blockio.py). Blocks already out run to the end; the
accounting keeps, in key order, only the successes before the first failure
(``loaded_prefix``).

Deadlines: ``expire_overdue`` (owner) fails a job past its deadline: its
queued blocks are dropped at once. Blocks already out cannot be interrupted.
A store job is reported right away anyway -- the job's cancel byte
(``IoJob.cancelled``) is set and the executor told (``job_expired``); a
block reads that byte before it starts and right before it publishes, so
it never publishes. A load job is reported only when its blocks are back, since the
kernel may still write into a row that vLLM would reuse once the job is
reported. Blocks still out for an expired job are "stuck"; while any is, the
volume is stalled (``stuck_blocks``).

Threading rules
---------------
* Owner (vLLM's scheduler side, one thread at a time): ``submit``,
  ``report`` (or its parts ``has_news``, ``expire_overdue`` and
  ``take_finished``), the gauges. ``submit``
  takes no lock -- it appends to ``_incoming`` and bumps counters only it
  writes -- because a lock shared with the executor's threads makes the
  owner wait for GIL hand-offs (docs/benchmarks.md, "Figures behind the
  code").
* Executor threads: ``take`` and ``slice_done``, each one short hold of the
  scheduler lock.
* One lock, never held across I/O, a syscall or a call into the executor.
* ``drain`` and ``shutdown`` block the caller; they are for reset and exit.

Accounting (owner side, ``report``): a finished job becomes a
``FinishedJob`` -- which keys vLLM may use, the counters every outcome
feeds, the throttled log of failures, and the keys whose loads would fail
again (``FinishedJob.unreadable``, ``foreign``: the lookups remember them
as misses for a while). Nothing of it touches the volume.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from llmkv_fs.engine.outcomes import (
    CANCELLED,
    DEADLINE,
    SKIPPED,
    BlockResult,
    CounterKey,
    Direction,
    Failed,
    Failure,
    Outcome,
    Tally,
)
from llmkv_fs.layout.blockfile import BlockFileError

__all__ = [
    "BlockScheduler",
    "BlockSlice",
    "BlockSource",
    "Executor",
    "FinishedJob",
    "IoJob",
    "JobAccountant",
    "QueueFull",
    "ThrottledErrorLog",
    "loaded_prefix",
]

logger = logging.getLogger("vllm.llmkv_fs.engine")


# -- jobs ------------------------------------------------------------------------------


class QueueFull(Exception):
    """A store job would push the store queue past its bound."""


class IoJob:
    """One submitted job. ``keys[i]`` goes to/from primary chunk ``chunks[i]``.

    ``outcomes[i]`` is None until block i finishes, then its BlockResult: an
    Outcome, or a Failed (CANCELLED, DEADLINE, SKIPPED, or why it failed).
    ``first_start``/``last_end`` bound the I/O time.

    Threading: its bookkeeping (everything but the immutable ``job_id``,
    ``is_load``, ``keys``, ``chunks``, ``submitted``, ``deadline``) changes
    only under the scheduler's lock, which alone writes it; executors read
    the immutable fields and ``cancelled``. After the job is reported the
    owner reads ``outcomes`` and ``io_seconds`` (the accounting below).
    """

    __slots__ = (
        "cancelled",
        "chunks",
        "deadline",
        "expired",
        "first_start",
        "is_load",
        "job_id",
        "keys",
        "last_end",
        "left",
        "next_block",
        "outcomes",
        "reported",
        "running",
        "submitted",
    )

    def __init__(
        self,
        job_id: int,
        is_load: bool,
        keys: Sequence[bytes],
        chunks: Sequence[int],
        timeout: float | None = None,
    ):
        self.job_id = job_id
        self.is_load = is_load
        self.keys = keys
        self.chunks = chunks
        self.outcomes: list[BlockResult | None] = [None] * len(keys)
        self.left = len(keys)  # blocks without an outcome
        self.submitted = time.monotonic()
        self.deadline = None if timeout is None else self.submitted + timeout
        self.first_start: float | None = None
        self.last_end = 0.0
        self.running = 0  # blocks handed to an executor, not back yet
        self.expired = False
        # Set (nonzero) once the deadline failed this job: a block reads it
        # before it starts and a store right before it publishes. A byte, not
        # a call, so I/O threads and worker processes (a byte of the cancel
        # board) read the same kind of thing.
        self.cancelled = bytearray(1)
        self.reported = False  # handed to the finished deque
        self.next_block = 0  # first block not handed out yet

    @property
    def io_seconds(self) -> float:
        return self.last_end - self.first_start if self.first_start is not None else 0.0


class BlockSlice(NamedTuple):
    """Blocks ``first`` .. ``first + n_blocks - 1`` of ``job`` (their
    ``keys`` and ``chunks``), handed to one executor place together by the
    scheduler; the place gives them back together, with a result each
    (``BlockScheduler.slice_done``). One job's blocks only, so one deadline
    (and one cancel byte) covers them."""

    job: IoJob
    first: int
    n_blocks: int
    keys: Sequence[bytes]
    chunks: Sequence[int]


# -- what runs the blocks ----------------------------------------------------------------


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
        """``job`` passed its deadline while blocks of it may be out (its
        ``cancelled`` byte is set): tell them where they cannot read that
        byte, so that a store is never published (owner thread; cheap)."""
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


# -- the scheduler -----------------------------------------------------------------------


class BlockScheduler:
    """See the module doc. ``start(executor)`` once, ``shutdown()`` once."""

    def __init__(
        self,
        max_queued_store_blocks: int,
        slice_blocks: int = 1,
        accountant: JobAccountant | None = None,
        least_slice_blocks: int = 1,
    ):
        self._accountant = accountant
        self._max_queued_stores = max_queued_store_blocks
        self._slice_blocks = max(1, slice_blocks)
        self._least_slice = max(1, min(self._slice_blocks, least_slice_blocks))
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
        # Of those, blocks of expired jobs (owner reads it): nonzero means the
        # volume is not answering.
        self.stuck_blocks = 0
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

    def submit(
        self,
        job_id: int,
        is_load: bool,
        keys: Sequence[bytes],
        chunks: Sequence[int],
        timeout: float | None = None,
    ) -> IoJob:
        """Queue every block of a new job (``IoJob``, returned) whose
        deadline is ``timeout`` seconds from now. Raises QueueFull (nothing
        queued) for a store job that does not fit, and RuntimeError after
        shutdown."""
        job = IoJob(job_id, is_load, keys, chunks, timeout)
        n = len(keys)
        if self._stopping:
            raise RuntimeError("llmkv_fs I/O scheduler is shut down")
        if not n:  # nothing to move: done now, or it would never finish
            job.reported = True
            self._finished.append(job)
            return job
        if not is_load:
            queued = self._blocks_in[False] - self._blocks_out[False]
            # A store job bigger than the bound alone still gets an empty
            # queue, or a long prompt could never be stored at all.
            if queued and queued + n > self._max_queued_stores:
                raise QueueFull(job.job_id)
        self._blocks_in[job.is_load] += n
        self._jobs_in += 1
        if job.deadline is not None:
            self._watched.append(job)
        self._incoming.append(job)
        executor = self._executor
        assert executor is not None, "start() first"
        executor.work_arrived(n)
        return job

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

    def report(self) -> tuple[int, list[FinishedJob]] | None:
        """The owner's one call per poll: None when there is nothing to
        report (cheap: vLLM polls every millisecond); else the blocks failed
        by their deadline just now (``expire_overdue``) and every finished
        job, accounted (the accountant given at construction)."""
        if not self.has_news():
            return None
        expired = self.expire_overdue()
        account = self._accountant
        assert account is not None, "report() needs an accountant"
        if expired:
            account.counters[Tally.DEADLINE_EXPIRED] += expired
            account.error_log.report("deadline", f"{expired} block(s) passed job_timeout_s")
        return expired, [account.account(job) for job in self.take_finished()]

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
            job.cancelled[0] = 1
            out = job.running
            self.stuck_blocks += out
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
                # (or the cap); less work spreads in the least slices.
                queued = self._blocks_in[is_load] - self._blocks_out[is_load]
                spread = max(self._least_slice, queued // (2 * self._places))
                count = min(left, self._slice_blocks, spread)
            job.next_block = first + count
            if job.next_block == len(job.keys):
                queue.popleft()
            self._blocks_out[is_load] += count
            self._in_flight += count
            self._slices_out += 1
            job.running += count
            if job.first_start is None:
                job.first_start = time.monotonic()
            end = first + count
            return BlockSlice(job, first, count, job.keys[first:end], job.chunks[first:end])

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
                self.stuck_blocks -= taken.n_blocks
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


# -- accounting ---------------------------------------------------------------------------

# Load failures after which the key answers MISS for failed_load_miss_s:
# the file is still there and would fail the same way (EIO, a bad file that
# could not be moved aside, no checksum, another key's seal) for every new
# request.
_KEEP_MISSING = frozenset((Failure.ERROR, Failure.NO_CHECKSUM, Failure.FOREIGN_KEY))


def loaded_prefix(outcomes: list[BlockResult | None]) -> list[BlockResult | None]:
    """A load job's outcomes as vLLM can use them: the successes before the
    first failure, in key order (its built-in reports just that prefix).
    Later successes -- read on another thread before the failure stopped the
    job -- become SKIPPED; later failures keep their own reason."""
    for cut, outcome in enumerate(outcomes):
        if not isinstance(outcome, Outcome):
            rest = [SKIPPED if isinstance(o, Outcome) else o for o in outcomes[cut + 1 :]]
            return outcomes[: cut + 1] + rest
    return outcomes


@dataclasses.dataclass(frozen=True)
class FinishedJob:
    job_id: int
    is_load: bool
    succeeded: list[bytes]
    failed: list[bytes]
    io_seconds: float
    nbytes: int  # bytes actually moved (existing blocks and failures excluded)
    latency: float = 0.0  # submit to reported, seconds
    quarantined: list[bytes] = dataclasses.field(default_factory=list)  # bad files moved aside
    missing: list[bytes] = dataclasses.field(default_factory=list)  # loads: no file (any more)
    # stores: written over a file this replica would not load (Outcome.REPLACED)
    replaced: list[bytes] = dataclasses.field(default_factory=list)
    # loads: failed, and would fail again the same way (the file is still
    # there: EIO, bad and left in place, no checksum) ...
    unreadable: list[bytes] = dataclasses.field(default_factory=list)
    # ... or sealed with a key this reader does not hold
    foreign: list[bytes] = dataclasses.field(default_factory=list)

    @property
    def success(self) -> bool:
        return not self.failed


class ThrottledErrorLog:
    """One warning per kind every ``interval`` seconds: a full or broken
    volume fails every block, and a line per block would drown the log."""

    def __init__(self, interval: float = 10.0):
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()

    def report(self, kind: str, error: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self._interval) < self._interval:
            self._suppressed[kind] += 1
            return
        self._last[kind] = now
        also = self._suppressed.pop(kind, 0)
        logger.warning(
            "llmkv_fs: %s of a block failed: %r%s",
            kind,
            error,
            f" (and {also} more since the last report)" if also else "",
        )


class JobAccountant:
    """Turns a finished IoJob (the scheduler's) into a FinishedJob, counting each
    block's outcome into ``counters`` (the engine's, shared) and each job's
    submit-to-report time into ``job_latencies``."""

    def __init__(
        self,
        counters: collections.Counter[CounterKey],
        block_size: int,
        error_log: ThrottledErrorLog,
        miss_for_s: float,
    ):
        self.counters = counters
        self.block_size = block_size
        self.error_log = error_log
        self._miss_for_s = miss_for_s
        # Submit-to-report seconds per finished job, by direction; whoever
        # publishes metrics takes and clears them.
        self.job_latencies: dict[Direction, list[float]] = {d: [] for d in Direction}

    def account(self, job: IoJob) -> FinishedJob:
        """Owner side, once per finished job."""
        outcomes = job.outcomes
        first = outcomes[0] if outcomes else None
        # The common job: every block the same success. list.count compares
        # by identity in C, so this costs O(1) Python steps per job instead
        # of several per block (the owner's time per block: docs/benchmarks.md).
        if isinstance(first, Outcome) and outcomes.count(first) == len(outcomes):
            n = len(outcomes)
            self.counters[first] += n
            moved_blocks = 0 if first is Outcome.PRESENT else n
            keys = list(job.keys)
            replaced = keys if first is Outcome.REPLACED else None
            return self._finished(job, keys, [], moved_blocks, [], replaced=replaced)
        return self._account_each(job)

    def _account_each(self, job: IoJob) -> FinishedJob:
        succeeded: list[bytes] = []
        failed: list[bytes] = []
        quarantined: list[bytes] = []
        missing: list[bytes] = []
        unreadable: list[bytes] = []  # failed loads whose file is still there
        replaced: list[bytes] = []
        foreign: list[bytes] = []  # ... sealed with a key this reader does not hold
        count = self.counters
        direction = Direction.LOAD if job.is_load else Direction.STORE
        moved_blocks = 0
        outcomes = loaded_prefix(job.outcomes) if job.is_load else job.outcomes
        for key, outcome in zip(job.keys, outcomes):
            if isinstance(outcome, Outcome):  # the common case: a success
                succeeded.append(key)
                count[outcome] += 1
                moved_blocks += outcome is not Outcome.PRESENT
                if outcome is Outcome.REPLACED:
                    replaced.append(key)
                continue
            failed.append(key)
            assert outcome is not None, "a reported job has every block's result"
            count[direction, outcome.reason] += 1
            error = outcome.error
            if isinstance(error, BlockFileError):
                count[error.reason] += 1
                if error.quarantined_to:
                    count[Tally.QUARANTINED] += 1
                    quarantined.append(key)
                    # Rare and important: every bad file is named.
                    logger.warning(
                        "llmkv_fs: bad block file (%s); moved to %s", error, error.quarantined_to
                    )
                else:
                    unreadable.append(key)
                    logger.warning(
                        "llmkv_fs: bad block file (%s) left in place: %s; it answers miss for %gs",
                        error,
                        error.left_because,
                        self._miss_for_s,
                    )
                continue
            if outcome.reason is Failure.MISSING:
                missing.append(key)
            if outcome.reason is Failure.FOREIGN_KEY:
                foreign.append(key)
            elif outcome.reason in _KEEP_MISSING:
                unreadable.append(key)
            if outcome.reason is Failure.ERROR:
                self.error_log.report(direction.value, error)
        finished = self._finished(
            job, succeeded, failed, moved_blocks, quarantined, missing, replaced
        )
        if job.is_load:
            finished.unreadable.extend(unreadable)
            finished.foreign.extend(foreign)
        return finished

    def _finished(
        self,
        job: IoJob,
        succeeded: list[bytes],
        failed: list[bytes],
        moved_blocks: int,
        quarantined: list[bytes],
        missing: list[bytes] | None = None,
        replaced: list[bytes] | None = None,
    ) -> FinishedJob:
        moved = moved_blocks * self.block_size
        self.counters[Tally.BYTES_READ if job.is_load else Tally.BYTES_WRITTEN] += moved
        latency = time.monotonic() - job.submitted
        self.job_latencies[Direction.LOAD if job.is_load else Direction.STORE].append(latency)
        return FinishedJob(
            job.job_id,
            job.is_load,
            succeeded,
            failed,
            job.io_seconds,
            moved,
            latency,
            quarantined,
            missing or [],
            replaced or [],
        )
