"""A submitted job and what every pool reports of it, whatever runs its
blocks (I/O threads in pool.py, worker processes in procpool.py).

Threading: an IoJob's outcome slots each have one writer (the thread or
conductor that ran that block); its counters change under its own lock. The
``JobReports`` methods are the owner's (vLLM's scheduler side).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from llmkv_fs.engine.outcomes import BlockResult, Failed

__all__ = ["IoJob", "JobReports", "QueueFull"]


class QueueFull(Exception):
    """A store job would push the store queue past its bound."""


class IoJob:
    """One submitted job. ``keys[i]`` goes to/from primary chunk ``chunks[i]``.

    ``outcomes[i]`` is None until block i finishes, then its BlockResult: an
    Outcome, or a Failed (CANCELLED, DEADLINE, or the exception it raised).
    ``first_start``/``last_end`` bound the I/O time.
    """

    __slots__ = (
        "_left",
        "_lock",
        "chunks",
        "deadline",
        "expired",
        "first_start",
        "is_load",
        "job_id",
        "keys",
        "last_end",
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
        self._left = len(keys)
        self._lock = threading.Lock()
        self.submitted = time.monotonic()
        self.deadline = None if timeout is None else self.submitted + timeout
        self.first_start: float | None = None
        self.last_end = 0.0
        self.running = 0  # blocks inside execute() right now
        self.expired = False
        self.reported = False  # handed to the finished deque
        self.next_block = 0  # first block no thread has taken (pool lock)

    def still_wanted(self) -> bool:
        """False once the deadline failed this job (I/O threads ask this
        before publishing a store)."""
        return not self.expired

    def _block_done(self, index: int, outcome: BlockResult) -> tuple[bool, bool]:
        """Record one executed block. Returns (this call finished the job and
        must report it, the block was stuck: its job expired meanwhile)."""
        with self._lock:
            self.running -= 1
            if self.reported:
                return False, True  # failed by the deadline without it
            # Only loads wait for in-flight blocks after expiring; a read
            # that did complete is as good as ever.
            self.outcomes[index] = outcome
            self.last_end = time.monotonic()
            self._left -= 1
            return self._claim_report(), self.expired

    def _fail(
        self, indices: Sequence[int], outcome: Failed, *, all_unfinished: bool = False
    ) -> bool:
        """Fail blocks that will not run (``all_unfinished``: also those in
        flight, whose results will be ignored). Caller holds ``_lock``.
        Returns whether the caller must now report the job."""
        if all_unfinished:
            indices = [i for i, o in enumerate(self.outcomes) if o is None]
        for index in indices:
            self.outcomes[index] = outcome
        self._left -= len(indices)
        now = time.monotonic()
        if self.first_start is None:
            self.first_start = now
        self.last_end = max(self.last_end, now)
        return self._claim_report()

    def _claim_report(self) -> bool:
        if self._left == 0 and not self.reported:
            self.reported = True
            return True
        return False

    @property
    def io_seconds(self) -> float:
        return self.last_end - self.first_start if self.first_start is not None else 0.0


class JobReports:
    """The owner-side half both pools share (IoPool here, ProcPool with worker
    processes): finished jobs wait in ``_finished`` (appended by whoever
    finishes a job, popped only by the owner), jobs with a deadline in
    ``_watched`` (submission order, hence deadline order), and ``_stuck``
    counts blocks of expired jobs still inside a syscall. A pool sets these
    three in its constructor and implements ``_expire``."""

    _finished: collections.deque[IoJob]
    _watched: collections.deque[IoJob]
    _stuck: int

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
        # The deque is appended by pool threads and popped only here: popleft
        # is atomic, so no lock is needed.
        finished = []
        while self._finished:
            finished.append(self._finished.popleft())
        return finished

    def stuck_blocks(self) -> int:
        """Blocks still inside a syscall although their job's deadline
        passed: nonzero means the volume is not answering."""
        return self._stuck

    def expire_overdue(self, now: float | None = None) -> int:
        """Fail every job past its deadline (see the module doc). Returns the
        number of blocks failed by it. Owner side; never blocks on I/O."""
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
        raise NotImplementedError
