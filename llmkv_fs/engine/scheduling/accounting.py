"""What the owner makes of a finished job: which keys vLLM may use (a
load keeps the prefix before its first failure, as vLLM's built-in does),
the counters every outcome feeds, the throttled log of failures, and the
keys that answer miss for a while because their file would fail again.

Threading: owner only (vLLM's scheduler side, under the manager's lock),
from FsEngine.take_finished; nothing here touches the volume.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable

from llmkv_fs.engine.outcomes import (
    SKIPPED,
    BlockResult,
    CounterKey,
    Direction,
    Failure,
    MissReason,
    Outcome,
    Tally,
)
from llmkv_fs.engine.scheduling.jobs import IoJob
from llmkv_fs.layout.blockfile import BlockFileError

__all__ = ["FinishedJob", "JobAccountant", "ThrottledErrorLog", "loaded_prefix"]

logger = logging.getLogger("vllm.llmkv_fs.engine")


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
        remember_misses: Callable[..., None],
        miss_for_s: float,
    ):
        self.counters = counters
        self.block_size = block_size
        self._error_log = error_log
        self._remember_misses = remember_misses
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
                self._error_log.report(direction.value, error)
        if job.is_load:
            if unreadable:
                self._remember_misses(unreadable)
            if foreign:
                self._remember_misses(foreign, why=MissReason.FOREIGN_KEY)
        return self._finished(job, succeeded, failed, moved_blocks, quarantined, missing, replaced)

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
