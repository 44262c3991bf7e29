"""FsEngine: the tier's machinery without vLLM -- one block scheduler driving
I/O threads or I/O worker processes (io_workers), batched off-thread lookups,
NUMA pinning, counters.

It speaks in plain terms (keys are bytes, chunks are row indices into the
primary, whole rows of ``block_size`` bytes), so it can be driven by the
vLLM adapter, by benchmarks or by tests alike.

Threading rules
---------------
The owner calls every public method from one thread at a time (in vLLM:
under the tiering manager's lock, from the scheduler or tier-poll thread).
``submit_*``, ``take_finished``, ``lookup``, ``end_step`` and
``forget_request`` never wait on the filesystem; ``drain`` and ``shutdown``
block by design (``drain`` can outlast the job deadline only for a load
whose read is stuck inside the kernel; see scheduling/scheduler.py). The
executors touch only the rows of the blocks they run and give each block
back to the scheduler; counters are updated by the owner in
``take_finished``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence

from llmkv_fs.config import TierSettings, store_queue_blocks
from llmkv_fs.engine.block.bytes_c import byte_path_line
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.block.presence import COMPILED_PRESENCE, presence_path
from llmkv_fs.engine.block.spec import StepSpec
from llmkv_fs.engine.launch import (
    Started,
    log_start,
    sealing,
    slice_blocks,
    start_executor,
)
from llmkv_fs.engine.lookup import AsyncExistence
from llmkv_fs.engine.outcomes import (
    CounterKey,
    Direction,
    Failure,
    LookupAnswer,
    Tally,
)
from llmkv_fs.engine.roots import EngineRoot, RootsPresence, close_roots, open_roots
from llmkv_fs.engine.scheduling.scheduler import (
    BlockScheduler,
    Executor,
    FinishedJob,
    JobAccountant,
    QueueFull,
    ThrottledErrorLog,
)
from llmkv_fs.engine.startup.io_setup import primary_bytes
from llmkv_fs.engine.startup.neighbours import log_other_deployments
from llmkv_fs.engine.startup.numa import PinningPlan, plan_pinning, read_topology
from llmkv_fs.engine.upkeep.prepare import EngineError
from llmkv_fs.layout.blockfile import Buffer
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.volume.leases import Lease

__all__ = ["EngineError", "FinishedJob", "FsEngine"]

logger = logging.getLogger("vllm.llmkv_fs.engine")


# Lookups are one metadata call each; one that waits this long (or the job
# deadline, if shorter) means the volume is not answering.
_LOOKUP_TIMEOUT_CAP_S = 5.0


class FsEngine:
    """The engine of one tier instance on its roots: one directory, or
    several that blocks are placed over by their hash (``layouts``: one
    CacheLayout per root, in the configured order; ``roots.py``).

    Constructing it prepares every root first (``prepare_volume``: the root
    is checked, ``config.json`` created or verified, the rank directory
    made), so no I/O thread ever starts on an unchecked volume. Raises
    EngineError (or RunConfigMismatch) with the path and the fix; VolumeError
    (an OSError) for an unusable root; RootListError for two roots that are
    one directory or nested.

    A lost root: while a root is not the directory the engine started on
    (each root's housekeeping thread re-checks it about once a second), the
    blocks placed on it fail ``Failure.ROOT_LOST``, lookups of its keys
    answer miss and nothing is created there; once every root is lost, jobs
    are refused at submit. It clears by itself when the directory is back.
    Each root's parts are in ``roots`` (``EngineRoot``).

    ``pause``: pause points for a test to hold blocks and lookup checks at
    known places (block/pause.py); they reach I/O threads, lookup threads
    and worker processes (through their launch). None (the default) runs
    none.
    """

    lookup: Callable[[bytes, str], bool | None]
    """``lookup(key, request_id)``: True/False when known, None (vLLM:
    RETRY) while its check is pending; MISS at once while the volume is
    stalled or the key's home root is lost. The lookups' own
    (``AsyncExistence.lookup``), bound at construction: vLLM asks every key
    of a prompt every step, and a call through here would double the
    frames of each."""

    def __init__(
        self,
        settings: TierSettings,
        layouts: CacheLayout | Sequence[CacheLayout],
        primary: Buffer,
        block_size: int,
        pause: PausePoints | None = None,
    ):
        self._settings = settings
        self.block_size = block_size
        self._primary = primary_bytes(primary, block_size)
        keyring, layouts = sealing(settings, layouts)
        self.keyring = keyring  # the sealing keys (None: blocks are not sealed)
        # Every root prepared (and its housekeeping started) before any I/O
        # thread or worker exists.
        self.roots: list[EngineRoot] = open_roots(
            settings, layouts, self._primary, block_size, keyring
        )
        self._placement = RootPlacement([root.root_dir for root in self.roots])
        # Each root's page its housekeeping writes (lost? stores refused?).
        self._signals = tuple(root.signals for root in self.roots)
        # What every block step is built from, in threads and workers alike.
        self._step_spec = StepSpec(tuple(r.spec for r in self.roots), self._placement, keyring)
        self._pause = pause
        self.pinning: PinningPlan = plan_pinning(read_topology(), settings.numa_node, self._primary)
        # Cumulative, updated by the owner only; tier/metrics.py publishes them.
        self._counters: collections.Counter[CounterKey] = collections.Counter()
        # Blocks by (root index, direction, succeeded), as placed (owner only).
        self.root_counters: collections.Counter[tuple[int, Direction, bool]] = collections.Counter()
        self._error_log = ThrottledErrorLog()
        self._rejected: list[FinishedJob] = []
        # As of the last _recheck() (the lookups are told too).
        self._stalled = False
        # Lost roots by index, as of the last recheck (the lookups are told).
        self._lost_roots: frozenset[int] = frozenset()
        self._stores_refused = False  # every root's guard, as of the same recheck
        self._slice_blocks, least = slice_blocks(block_size)
        accountant = JobAccountant(
            self._counters, block_size, self._error_log, settings.failed_load_miss_s
        )
        self.job_latencies = accountant.job_latencies
        self._scheduler = BlockScheduler(
            store_queue_blocks(settings, block_size),
            self._slice_blocks,
            accountant,
            least_slice_blocks=least,
        )
        self._started = self._start_io()
        self.io_workers = self._started.io_workers  # worker processes in use (0: I/O threads)
        self._executor: Executor = self._scheduler.executor
        self._lookups = self._start_lookups()
        self.lookup = self._lookups.lookup
        log_start(
            settings, self._started, self.pinning, self._presence_check(), keyring, self.roots
        )
        logger.info("llmkv_fs engine byte path: %s", byte_path_line(self.roots))
        for root in self.roots:  # config.json files and leases only: no block walk
            log_other_deployments(root.layout)

    def _start_io(self) -> Started:
        """The executor, then each root's headroom: every block the executor
        can hold may start a store the moment the guard lifts after ENOSPC."""
        started = start_executor(
            self._scheduler,
            self._settings,
            self._step_spec,
            self.roots,
            self._primary,
            self.pinning,
            self._pause,
        )
        held = self._scheduler.executor.capacity() * self._slice_blocks
        for root in self.roots:
            root.guard.headroom_bytes = self.block_size * (held + 1)
        return started

    def _start_lookups(self) -> AsyncExistence:
        """The lookups, given what they check keys against: the roots (they
        never call back into the engine)."""
        settings = self._settings
        self._presence = RootsPresence(self.roots, self._placement, self._pause)
        return AsyncExistence(
            self._presence,
            settings.lookup_threads,
            timeout=min(settings.job_timeout_s, _LOOKUP_TIMEOUT_CAP_S),
            miss_for_s=settings.failed_load_miss_s,
            placement=self._placement,
        )

    def _presence_check(self) -> str:
        """Which presence check the lookups run, for the start-up line."""
        presence = presence_path(self._settings.compiled_io)
        if presence == COMPILED_PRESENCE and not self._presence.batched:
            presence = "python (a root without openat2)"
        return presence

    # -- owner side --------------------------------------------------------------------

    def submit_store(self, job_id: int, keys: Sequence[bytes], chunks: Sequence[int]) -> bool:
        """Queue a store; False if it was refused -- the bounded queue is
        full, the space guard is tripped, the volume is stalled or failed. A
        refused job is reported failed by the next take_finished, without I/O."""
        refused = self._recheck()
        if refused is not None:
            return self._refuse(job_id, Direction.STORE, keys, refused)
        if self._stores_refused:
            # Each root's guard also refuses its own blocks in the step.
            return self._refuse(job_id, Direction.STORE, keys, Failure.SPACE)
        try:
            self._scheduler.submit(job_id, False, keys, chunks, self._settings.job_timeout_s)
            return True
        except QueueFull:
            return self._refuse(job_id, Direction.STORE, keys, Failure.QUEUE_FULL)

    def submit_load(self, job_id: int, keys: Sequence[bytes], chunks: Sequence[int]) -> bool:
        """Queue a load; False (reported failed at the next take_finished) if
        the volume is stalled or failed."""
        refused = self._recheck()
        if refused is not None:
            return self._refuse(job_id, Direction.LOAD, keys, refused)
        self._scheduler.submit(job_id, True, keys, chunks, self._settings.job_timeout_s)
        return True

    def _refuse(
        self, job_id: int, direction: Direction, keys: Sequence[bytes], reason: Failure
    ) -> bool:
        self.counters[direction, reason] += len(keys)
        is_load = direction is Direction.LOAD
        self._rejected.append(FinishedJob(job_id, is_load, [], list(keys), 0.0, 0))
        return False

    def _recheck(self) -> Failure | None:
        """Look again at the volume, never touching it, and tell the lookups
        (one call): which roots are lost, as of each housekeeping thread's
        last check, and whether the volume stopped answering (an expired
        job still has a block inside a syscall, or no lookup check answered
        for the lookup timeout; clears by itself when the calls return).
        Each root's page is read once: whether every root refuses stores
        (its space guard) is remembered for the next store submitted.
        Returns why a job submitted now is refused: ROOT_LOST when every
        root is lost (none is the directory the engine started on; with
        several roots, the blocks of a lost root fail one by one in the
        step, and lookups of its keys answer miss), STALLED, else None."""
        lost: list[int] = []
        refusing = 0
        for index, signals in enumerate(self._signals):  # a loop: no frame per root
            root_lost, refused = signals.store_flags()
            if root_lost:
                lost.append(index)
            if refused:
                refusing += 1
        self._lost_roots = frozenset(lost)
        self._stores_refused = refusing == len(self._signals)
        self._stalled = self._lookups.recheck(self._scheduler.stuck_blocks > 0, self._lost_roots)
        if len(lost) == len(self._signals):
            return Failure.ROOT_LOST
        return Failure.STALLED if self._stalled else None

    def take_finished(self) -> list[FinishedJob]:
        # One scheduler call per poll; None (the common case: vLLM polls
        # every millisecond) when it has nothing to report.
        report = self._scheduler.report()
        if report is None:
            if not self._rejected:
                return []
            report = (0, [])
        expired, results = report
        if expired:
            self._recheck()
        if self._rejected:
            results, self._rejected = self._rejected + results, []
        self._count_by_root(results)
        self._lookups.jobs_finished(results)
        return results

    def _count_by_root(self, results: list[FinishedJob]) -> None:
        counts = self.root_counters
        for result in results:
            direction = Direction.LOAD if result.is_load else Direction.STORE
            if len(self.roots) == 1:
                counts[0, direction, True] += len(result.succeeded)
                counts[0, direction, False] += len(result.failed)
                continue
            home = self._placement.home
            for key in result.succeeded:
                counts[home(key), direction, True] += 1
            for key in result.failed:
                counts[home(key), direction, False] += 1

    def miss_was_checked(self, key: bytes) -> bool:
        """Whether this step's MISS for ``key`` says the file is not there
        (a check looked and found none) rather than that nobody looked:
        refused while stalled or while its home root is lost, the lookup
        deadline passed, the check failed (EIO), or a load of it failed.
        Removal announcements trust only the former."""
        if self._stalled or (self._lost_roots and self._placement.home(key) in self._lost_roots):
            return False
        return not self._lookups.guessed_miss(key)

    @property
    def counters(self) -> collections.Counter[CounterKey]:
        """Cumulative counters (owner only), lookups included."""
        self._lookups.fold_tally(self._counters)
        return self._counters

    def end_step(self) -> None:
        self._lookups.end_step()
        # Cumulative in the executor; copied here so that only the owner
        # writes counters.
        self.counters[Tally.WORKER_DEATHS] = self._executor.deaths()
        self._recheck()
        expired = self._lookups.expire_overdue()
        if expired:
            self.counters[LookupAnswer.DEADLINE_MISS] += expired
            self._error_log.report("lookup", f"{expired} existence check(s) overdue; answered miss")

    def set_lease(self, lease: Lease) -> None:
        """Publish this tier's lease (written and refreshed by the
        housekeeping thread; removed at shutdown)."""
        for root in self.roots:
            root.housekeeping.set_lease(lease)

    def gauges(self) -> dict[str, float]:
        """Point-in-time state for metrics; cheap, owner side. Places are
        the executor's (``Executor.capacity``): ``busy_places`` of
        ``io_places`` hold a slice each, ``held_blocks`` are the blocks in
        those slices. Each root's own state is in ``root_gauges``."""
        scheduler = self._scheduler
        return {
            "queued_store_blocks": scheduler.queued_store_blocks(),
            "queued_load_blocks": scheduler.queued_load_blocks(),
            "busy_places": scheduler.busy_places(),
            "io_places": scheduler.places,
            "held_blocks": scheduler.blocks_in_flight(),
            "io_workers": len(self._executor.worker_pids()),
            "stuck_blocks": scheduler.stuck_blocks,
        }

    def root_gauges(self) -> dict[str, dict[str, float]]:
        """Each root's state for metrics, by root_dir; cheap, owner side,
        changes nothing (``end_step`` rechecks the roots every step)."""
        gauges: dict[str, dict[str, float]] = {}
        for root in self.roots:
            usage = root.guard.usage
            gauges[root.root_dir] = {
                "space_guard_tripped": 0 if root.guard.allows_store() else 1,
                "volume_failed": 1 if root.lost else 0,
                "volume_used_bytes": usage.used_bytes if usage else 0,
                "volume_free_bytes": usage.free_bytes if usage else 0,
            }
        return gauges

    def forget_request(self, request_id: str) -> None:
        self._lookups.forget_request(request_id)

    def has_pending_work(self) -> bool:
        return self._scheduler.busy() or bool(self._rejected)

    def drain(self) -> None:
        self._scheduler.drain()

    def shutdown(self) -> None:
        """Stop everything. The lookup threads, then the housekeeping
        threads of all roots together, are each waited for at most the
        lookup deadline, min(job_timeout_s, 5 s): a thread still inside a
        call on a volume that does not answer is left behind and logged
        (with the lease file it leaves). Blocks the executor holds are
        waited for within its own bound (``Executor.stop``: worker
        processes are killed after their grace; an I/O thread returns when
        its block's call does)."""
        started = time.monotonic()
        self._lookups.shutdown()
        self._scheduler.shutdown()
        if self._started.handover is not None:
            self._started.handover.close()
        close_roots(self.roots, min(self._settings.job_timeout_s, _LOOKUP_TIMEOUT_CAP_S))
        # Our view pins the primary mmap; vLLM unmaps it right after us.
        self._primary.release()
        logger.info("llmkv_fs engine stopped in %.3fs", time.monotonic() - started)
