"""FsEngine: the tier's machinery without vLLM -- one block scheduler driving
I/O threads or I/O worker processes (io_workers), batched off-thread lookups,
NUMA pinning, counters.

It speaks in plain terms (keys are bytes, chunks are row indices into one
flat buffer of ``num_chunks * block_size`` bytes), so it can be driven by the
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
import functools
import logging
import time
from collections.abc import Sequence

from llmkv_fs.config import TierSettings, store_queue_blocks
from llmkv_fs.engine.block.bytepath import BytePathKind, VectoredBytes
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
from llmkv_fs.engine.lookup_checks import Found
from llmkv_fs.engine.outcomes import (
    CounterKey,
    Direction,
    Failure,
    LookupAnswer,
    MissReason,
    Tally,
)
from llmkv_fs.engine.root_presence import at_once, each_key, on_their_roots
from llmkv_fs.engine.roots import EngineRoot, close_roots, open_roots
from llmkv_fs.engine.scheduling.accounting import FinishedJob, JobAccountant, ThrottledErrorLog
from llmkv_fs.engine.scheduling.executor import Executor
from llmkv_fs.engine.scheduling.jobs import IoJob, QueueFull
from llmkv_fs.engine.scheduling.scheduler import BlockScheduler
from llmkv_fs.engine.startup.io_setup import rows_view
from llmkv_fs.engine.startup.neighbours import log_other_deployments
from llmkv_fs.engine.startup.numa import PinningPlan, plan_pinning, read_topology
from llmkv_fs.engine.upkeep.prepare import EngineError
from llmkv_fs.layout.blockfile import Buffer
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.volume.leases import Lease

__all__ = ["EngineError", "FinishedJob", "FsEngine"]

logger = logging.getLogger("vllm.llmkv_fs.engine")


_LOOKUP_ANSWER = {True: LookupAnswer.HIT, False: LookupAnswer.MISS, None: LookupAnswer.RETRY}
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

    Volume failed: while a root is not the directory the engine started on
    (each root's housekeeping thread re-checks it about once a second), the
    blocks placed on it fail ``Failure.VOLUME_FAILED``, lookups of its keys
    answer miss and nothing is created there; once every root is lost, jobs
    are refused at submit. It clears by itself when the directory is back.
    Each root's parts are in ``roots`` (``EngineRoot``).

    ``byte_path`` moves a block's bytes once its file is open (the seam for
    another implementation, block/bytepath.py); it reaches I/O threads and
    worker processes alike through the step spec (``step_spec``).

    ``pause``: pause points for a test to hold blocks and lookup checks at
    known places (block/pause.py); they reach I/O threads, lookup threads
    and worker processes (through their launch). None (the default) runs
    none.
    """

    def __init__(
        self,
        settings: TierSettings,
        layouts: CacheLayout | Sequence[CacheLayout],
        primary: Buffer,
        block_size: int,
        byte_path: BytePathKind = VectoredBytes,
        pause: PausePoints | None = None,
    ):
        self.settings = settings
        self.block_size = block_size
        self._flat = rows_view(primary, block_size)
        self.num_chunks = self._flat.nbytes // block_size
        keyring, layouts = sealing(settings, layouts)
        # Every root prepared (and its housekeeping started) before any I/O
        # thread or worker exists.
        self.roots: list[EngineRoot] = open_roots(
            settings, layouts, self._flat, block_size, byte_path, keyring
        )
        self.placement = RootPlacement([root.root_dir for root in self.roots])
        # What every block step is built from, in threads and workers alike.
        self.step_spec = StepSpec(
            tuple(r.spec for r in self.roots), self.placement, byte_path, keyring
        )
        self.pause = pause
        self.pinning: PinningPlan = plan_pinning(read_topology(), settings.numa_node, self._flat)
        # Cumulative, updated by the owner only; tier/metrics.py publishes them.
        self._counters: collections.Counter[CounterKey] = collections.Counter()
        # Lookups by verdict, folded into the counters when read: one dict
        # increment per lookup, the enum-keyed Counter only when read.
        self._lookup_tally: dict[bool | None, int] = dict.fromkeys((True, False, None), 0)
        # Lookups answered miss by why, folded likewise; they sum to the misses.
        self._miss_tally: dict[MissReason, int] = dict.fromkeys(MissReason, 0)
        # Blocks by (root index, direction, succeeded), as placed (owner only).
        self.root_counters: collections.Counter[tuple[int, Direction, bool]] = collections.Counter()
        self._error_log = ThrottledErrorLog()
        self._rejected: list[FinishedJob] = []
        self._stalled = False  # as of the last recheck_stalled() (lookups read this)
        # Lost roots by index, as of the last end_step() (lookups read this).
        self._lost_roots: frozenset[int] = frozenset()
        self.slice_blocks = slice_blocks(block_size)
        self._scheduler = BlockScheduler(
            store_queue_blocks(settings, block_size), self.slice_blocks
        )
        self._started = self._start_io()
        self.io_workers = self._started.io_workers  # worker processes in use (0: I/O threads)
        self._executor: Executor = self._scheduler.executor
        self._lookups = self._start_lookups()
        self._accountant = JobAccountant(
            self._counters,
            block_size,
            self._error_log,
            self._lookups.remember_misses,
            settings.failed_load_miss_s,
        )
        self.job_latencies = self._accountant.job_latencies
        log_start(settings, self._started, self.pinning, self._presence(), keyring, self.roots)
        logger.info("llmkv_fs engine byte path: %s", byte_path_line(self.roots, self.io_workers))
        for root in self.roots:  # config.json files and leases only: no block walk
            log_other_deployments(root.layout)

    def _start_io(self) -> Started:
        """The executor, then each root's headroom: every block the executor
        can hold may start a store the moment the guard lifts after ENOSPC."""
        started = start_executor(
            self._scheduler,
            self.settings,
            self.step_spec,
            self.roots,
            self._flat,
            self.pinning,
            self.pause,
        )
        held = self._scheduler.executor.capacity() * self.slice_blocks
        for root in self.roots:
            root.guard.headroom_bytes = self.block_size * (held + 1)
        return started

    def _start_lookups(self) -> AsyncExistence:
        settings = self.settings
        return AsyncExistence(
            self._exists_on_its_roots,
            settings.lookup_threads,
            timeout=min(settings.job_timeout_s, _LOOKUP_TIMEOUT_CAP_S),
            miss_for_s=settings.failed_load_miss_s,
            exist_many=self._exist_on_their_roots if self._checks_in_batches() else None,
        )

    def _exists_on_its_roots(self, key: bytes) -> Found:
        """A lookup thread's check: the key's home root, then (several
        roots) its second choice (see ``RootPlacement``); a lost root is
        not touched (root_presence.py: a key it may hold answers None)."""
        if self.pause is not None:  # a check held as in a stalled mount
            self.pause.reached("exists", "lookup", key)
        return on_their_roots(self.roots, self.placement, [key], each_key)[0]

    def _exist_on_their_roots(self, keys: list[bytes], budget_s: float) -> list[Found]:
        """A lookup thread's check of a chunk of keys at once (the compiled
        presence check; same roots and rules as ``_exists_on_its_roots``),
        of the first keys only if ``budget_s`` is spent first. Pause points
        stop at each key before the chunk's one call."""
        if self.pause is not None:  # a check held as in a stalled mount
            for key in keys:
                self.pause.reached("exists", "lookup", key)
        return on_their_roots(
            self.roots, self.placement, keys, functools.partial(at_once, budget_s=budget_s)
        )

    def _presence(self) -> str:
        """Which presence check the lookups run, for the start-up line."""
        presence = presence_path()
        if presence == COMPILED_PRESENCE and not self._checks_in_batches():
            presence = "python (a root without openat2)"
        return presence

    def _checks_in_batches(self) -> bool:
        """Lookups check chunks in one compiled call: every root can."""
        return all(r.blockio.checks_in_batches for r in self.roots)

    # -- owner side --------------------------------------------------------------------

    def submit_store(self, job_id: int, keys: Sequence[bytes], chunks: Sequence[int]) -> bool:
        """Queue a store; False if it was refused -- the bounded queue is
        full, the space guard is tripped, the volume is stalled or failed. A
        refused job is reported failed by the next take_finished, without I/O."""
        if self.recheck_volume_failed():
            return self._refuse(job_id, Direction.STORE, keys, Failure.VOLUME_FAILED)
        if self.recheck_stalled():
            return self._refuse(job_id, Direction.STORE, keys, Failure.STALLED)
        if not any(root.guard.allows_store() for root in self.roots):
            # Each root's guard also refuses its own blocks in the step.
            return self._refuse(job_id, Direction.STORE, keys, Failure.SPACE)
        try:
            self._scheduler.submit(IoJob(job_id, False, keys, chunks, self.settings.job_timeout_s))
            return True
        except QueueFull:
            return self._refuse(job_id, Direction.STORE, keys, Failure.QUEUE_FULL)

    def submit_load(self, job_id: int, keys: Sequence[bytes], chunks: Sequence[int]) -> bool:
        """Queue a load; False (reported failed at the next take_finished) if
        the volume is stalled or failed."""
        if self.recheck_volume_failed():
            return self._refuse(job_id, Direction.LOAD, keys, Failure.VOLUME_FAILED)
        if self.recheck_stalled():
            return self._refuse(job_id, Direction.LOAD, keys, Failure.STALLED)
        self._scheduler.submit(IoJob(job_id, True, keys, chunks, self.settings.job_timeout_s))
        return True

    def _refuse(
        self, job_id: int, direction: Direction, keys: Sequence[bytes], reason: Failure
    ) -> bool:
        self.counters[direction, reason] += len(keys)
        is_load = direction is Direction.LOAD
        self._rejected.append(FinishedJob(job_id, is_load, [], list(keys), 0.0, 0))
        return False

    def recheck_stalled(self) -> bool:
        """Look again whether the volume stopped answering (an expired job
        still has a block inside a syscall, or no lookup check answered for
        the lookup timeout), remember the verdict for lookups and return it.
        Clears by itself when the calls return."""
        self._stalled = self._scheduler.stuck_blocks() > 0 or self._lookups.stuck()
        return self._stalled

    def recheck_volume_failed(self) -> bool:
        """Look again which roots are lost (as of each housekeeping thread's
        last check; never touches the filesystem), remember them for
        lookups and return whether every root is: none is the directory the
        engine started on. With several roots, the blocks of a lost root fail one
        by one in the step, and lookups of its keys answer miss."""
        lost = [index for index, root in enumerate(self.roots) if root.lost]
        self._lost_roots = frozenset(lost)
        return len(lost) == len(self.roots)

    def take_finished(self) -> list[FinishedJob]:
        if not self._rejected and not self._scheduler.has_news():
            return []  # vLLM polls every millisecond: keep the empty case cheap
        expired = self._scheduler.expire_overdue()
        if expired:
            self.recheck_stalled()
            self.counters[Tally.DEADLINE_EXPIRED] += expired
            self._error_log.report("deadline", f"{expired} block(s) passed job_timeout_s")
        results, self._rejected = self._rejected, []
        for job in self._scheduler.take_finished():
            results.append(self._accountant.account(job))
        self._count_by_root(results)
        for result in results:
            if result.is_load:
                self._lookups.set_verdict(result.failed, False)
            else:
                # A file remembered as unloadable that the store wrote over
                # is a good block now.
                self._lookups.forget_misses(result.replaced)
                self._lookups.set_verdict(result.succeeded, True)
        return results

    def _count_by_root(self, results: list[FinishedJob]) -> None:
        counts = self.root_counters
        for result in results:
            direction = Direction.LOAD if result.is_load else Direction.STORE
            if len(self.roots) == 1:
                counts[0, direction, True] += len(result.succeeded)
                counts[0, direction, False] += len(result.failed)
                continue
            home = self.placement.home
            for key in result.succeeded:
                counts[home(key), direction, True] += 1
            for key in result.failed:
                counts[home(key), direction, False] += 1

    def lookup(self, key: bytes, request_id: str) -> bool | None:
        # The step's cached verdict: a per-key clock read would cost more
        # than the lookup itself, and a stall is detected per step anyway.
        # vLLM asks every key of a prompt every step: nothing more here. A
        # miss (asked again only up to the first one of a prompt) also
        # counts why, once per lookup answered False.
        if self._stalled or self._lost_roots:
            if self._stalled:
                refused: MissReason | None = MissReason.STALLED
            elif self.placement.home(key) in self._lost_roots:
                refused = MissReason.LOST_ROOT
            else:
                refused = None
            if refused is not None:
                self._lookup_tally[False] += 1
                self._miss_tally[refused] += 1
                return False
        verdict = self._lookups.lookup(key, request_id)
        self._lookup_tally[verdict] += 1
        if verdict is False:
            self._miss_tally[self._lookups.miss_reason(key)] += 1
        return verdict

    def miss_was_checked(self, key: bytes) -> bool:
        """Whether this step's MISS for ``key`` says the file is not there
        (a check looked and found none) rather than that nobody looked:
        refused while stalled or while its home root is lost, the lookup
        deadline passed, the check failed (EIO), or a load of it failed.
        Removal announcements trust only the former."""
        if self._stalled or (self._lost_roots and self.placement.home(key) in self._lost_roots):
            return False
        return not self._lookups.guessed_miss(key)

    @property
    def counters(self) -> collections.Counter[CounterKey]:
        """Cumulative counters (owner only), lookups included."""
        tally = self._lookup_tally
        if tally[True] or tally[False] or tally[None]:
            for verdict, count in tally.items():
                self._counters[_LOOKUP_ANSWER[verdict]] += count
                tally[verdict] = 0
            for reason, count in self._miss_tally.items():
                if count:
                    self._counters[reason] += count
                    self._miss_tally[reason] = 0
        return self._counters

    def end_step(self) -> None:
        self._lookups.end_step()
        # Cumulative in the executor; copied here so that only the owner
        # writes counters.
        self.counters[Tally.WORKER_DEATHS] = self._executor.deaths()
        self.recheck_stalled()
        self.recheck_volume_failed()
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
            "stuck_blocks": scheduler.stuck_blocks(),
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

    @property
    def lookups(self) -> AsyncExistence:
        """The existence checks behind lookup(): tests read how many keys
        it tracks and drive its deadlines with an explicit clock."""
        return self._lookups

    def forget_request(self, request_id: str) -> None:
        self._lookups.forget_request(request_id)

    def has_pending_work(self) -> bool:
        return self._scheduler.busy() or bool(self._rejected)

    def queued_store_blocks(self) -> int:
        return self._scheduler.queued_store_blocks()

    @property
    def executor(self) -> Executor:
        """What runs the blocks (tests ask it for worker pids and deaths)."""
        return self._executor

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
        close_roots(self.roots, min(self.settings.job_timeout_s, _LOOKUP_TIMEOUT_CAP_S))
        # Our view pins the primary mmap; vLLM unmaps it right after us.
        self._flat.release()
        logger.info("llmkv_fs engine stopped in %.3fs", time.monotonic() - started)
