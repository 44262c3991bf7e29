"""A submitted job and one of its blocks handed to an executor.

Threading: an IoJob's bookkeeping (everything but the immutable ``job_id``,
``is_load``, ``keys``, ``chunks``, ``submitted``, ``deadline``) changes only
under the scheduler's lock (scheduler.py), which alone writes it; executors
read the immutable fields and ask ``still_wanted``. After the job is reported
the owner reads ``outcomes`` and ``io_seconds`` (accounting.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from llmkv_fs.engine.outcomes import BlockResult

__all__ = ["BlockSlice", "IoJob", "QueueFull"]


class QueueFull(Exception):
    """A store job would push the store queue past its bound."""


class IoJob:
    """One submitted job. ``keys[i]`` goes to/from primary chunk ``chunks[i]``.

    ``outcomes[i]`` is None until block i finishes, then its BlockResult: an
    Outcome, or a Failed (CANCELLED, DEADLINE, SKIPPED, or why it failed).
    ``first_start``/``last_end`` bound the I/O time.
    """

    __slots__ = (
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
        self.reported = False  # handed to the finished deque
        self.next_block = 0  # first block not handed out yet

    def still_wanted(self) -> bool:
        """False once the deadline failed this job (an I/O thread asks this
        before starting a block and before publishing a store)."""
        return not self.expired

    @property
    def io_seconds(self) -> float:
        return self.last_end - self.first_start if self.first_start is not None else 0.0


class BlockSlice(NamedTuple):
    """Blocks ``first`` .. ``first + n_blocks - 1`` of ``job``, handed to one
    executor place together by the scheduler; the place gives them back
    together, with a result each (``BlockScheduler.slice_done``). One job's
    blocks only, so one deadline (and one cancel byte) covers them."""

    job: IoJob
    first: int
    n_blocks: int

    @property
    def keys(self) -> Sequence[bytes]:
        return self.job.keys[self.first : self.first + self.n_blocks]

    @property
    def chunks(self) -> Sequence[int]:
        return self.job.chunks[self.first : self.first + self.n_blocks]
