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
import logging
import os
import time
from collections.abc import Sequence

import xxhash

from llmkv_fs.config import TierSettings, store_queue_blocks
from llmkv_fs.engine.block.bytepath import BytePathKind, VectoredBytes
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.block.spec import StepSpec, build_step
from llmkv_fs.engine.lookup import AsyncExistence
from llmkv_fs.engine.outcomes import CounterKey, Direction, Failure, LookupAnswer, Tally
from llmkv_fs.engine.roots import EngineRoot, open_roots
from llmkv_fs.engine.scheduling.accounting import FinishedJob, JobAccountant, ThrottledErrorLog
from llmkv_fs.engine.scheduling.executor import Executor
from llmkv_fs.engine.scheduling.jobs import IoJob, QueueFull
from llmkv_fs.engine.scheduling.scheduler import BlockScheduler
from llmkv_fs.engine.startup.hash_path import xxh3_path
from llmkv_fs.engine.startup.io_setup import for_worker_processes, io_thread_counts, rows_view
from llmkv_fs.engine.startup.numa import PinningPlan, plan_pinning, read_topology
from llmkv_fs.engine.threads.executor import ThreadExecutor
from llmkv_fs.engine.upkeep.prepare import EngineError
from llmkv_fs.engine.workers.crew import WorkerSpec, resolve_io_workers
from llmkv_fs.engine.workers.executor import ProcessExecutor
from llmkv_fs.engine.workers.region import NoHandover, RegionHandover, find_handover
from llmkv_fs.layout.blockfile import Buffer
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.volume.leases import Lease
from llmkv_fs.volume.root import RootGone

__all__ = ["EngineError", "FinishedJob", "FsEngine"]

logger = logging.getLogger("vllm.llmkv_fs.engine")


_LOOKUP_ANSWER = {True: LookupAnswer.HIT, False: LookupAnswer.MISS, None: LookupAnswer.RETRY}
# An executor place takes up to this many bytes of one job's blocks at once
# (a slice: one scheduler round trip, one record to a worker): a 2 MiB block
# still travels alone, 64 KiB ones by 16 (docs/benchmarks.md, "Small blocks").
_SLICE_BYTES = 1 << 20
_SLICE_MAX_BLOCKS = 16


def slice_blocks(block_size: int) -> int:
    """How many blocks of one job an executor place may take at once."""
    return max(1, min(_SLICE_MAX_BLOCKS, _SLICE_BYTES // block_size))


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
    """

    def __init__(
        self,
        settings: TierSettings,
        layouts: CacheLayout | Sequence[CacheLayout],
        primary: Buffer,
        block_size: int,
        byte_path: BytePathKind = VectoredBytes,
    ):
        self.settings = settings
        self.block_size = block_size
        self._flat = rows_view(primary, block_size)
        self.num_chunks = self._flat.nbytes // block_size
        if isinstance(layouts, CacheLayout):
            layouts = (layouts,)
        # Every root prepared (and its housekeeping started) before any I/O
        # thread or worker exists.
        self.roots: list[EngineRoot] = open_roots(
            settings, layouts, self._flat, block_size, byte_path
        )
        self.placement = RootPlacement([root.root_dir for root in self.roots])
        # What every block step is built from, in threads and workers alike.
        self.step_spec = StepSpec(tuple(r.spec for r in self.roots), self.placement, byte_path)
        self.pause = PausePoints.from_environment()  # tests only (block/pause.py)
        self.pinning: PinningPlan = plan_pinning(read_topology(), settings.numa_node, self._flat)
        # Cumulative, updated by the owner only; tier/metrics.py publishes them.
        self.counters: collections.Counter[CounterKey] = collections.Counter()
        # Blocks by (root index, direction, succeeded), as placed (owner only).
        self.root_counters: collections.Counter[tuple[int, Direction, bool]] = collections.Counter()
        self._error_log = ThrottledErrorLog()
        self._rejected: list[FinishedJob] = []
        self._stalled = False  # as of the last stalled() (lookups read this)
        # Lost roots by index, as of the last end_step() (lookups read this).
        self._lost_roots: frozenset[int] = frozenset()
        self._handover: RegionHandover | None = None
        self._threads_why = ""  # why fewer I/O threads run than the settings ask, if so
        self.slice_blocks = slice_blocks(block_size)
        self._scheduler = BlockScheduler(
            store_queue_blocks(settings, block_size), self.slice_blocks
        )
        self.io_workers = self._start_executor()  # worker processes in use (0: I/O threads)
        self._executor: Executor = self._scheduler.executor
        for root in self.roots:
            # Every block the executor can hold may start a store the moment
            # the guard lifts after ENOSPC.
            held = self._executor.capacity() * self.slice_blocks
            root.guard.headroom_bytes = block_size * (held + 1)
        self._lookups = AsyncExistence(
            self._exists_on_its_roots,
            settings.lookup_threads,
            timeout=min(settings.job_timeout_s, _LOOKUP_TIMEOUT_CAP_S),
            miss_for_s=settings.failed_load_miss_s,
        )
        self._accountant = JobAccountant(
            self.counters,
            block_size,
            self._error_log,
            self._lookups.remember_misses,
            settings.failed_load_miss_s,
        )
        self.job_latencies = self._accountant.job_latencies
        self._log_start()

    def _exists_on_its_roots(self, key: bytes) -> bool:
        """A lookup thread's check: the key's home root, then (several
        roots) its second choice (see ``RootPlacement``); a lost root
        answers no without being touched."""
        for index in self.placement.choices(key):
            root = self.roots[index]
            if root.signals.root_lost:
                continue
            try:
                if root.blockio.exists(key):
                    return True
            except RootGone:  # lost since its housekeeping last looked: as if lost
                continue
        return False

    def _log_start(self) -> None:
        settings = self.settings
        if self.io_workers:
            workers = f"{self.io_workers} worker processes (nice +{settings.io_workers_nice})"
        else:
            executor = self._executor
            assert isinstance(executor, ThreadExecutor)
            workers = (
                f"{executor.n_read_threads} read + {executor.n_write_threads} write "
                f"threads{self._threads_why}"
            )
            if settings.io_workers_nice:
                workers += " (io_workers_nice applies to worker processes only: not used)"
        logger.info(
            "llmkv_fs engine: %s, durability=%s, checksum=%s (xxh3 of python-xxhash %s: %s), "
            "numa: %s",
            workers,
            settings.durability,
            settings.checksum,
            xxhash.VERSION,
            xxh3_path(),
            self.pinning.reason,
        )
        for root in self.roots:
            logger.info(
                "llmkv_fs engine root: %s, %s I/O",
                root.layout.rank_dir,
                "O_DIRECT" if root.use_o_direct else "buffered",
            )

    # -- executors ---------------------------------------------------------------------

    def _start_executor(self) -> int:
        """Start worker processes when io_workers asks for them and the
        primary can be handed over, else I/O threads (the reason logged
        once). Returns the number of worker processes (0: threads)."""
        wanted = resolve_io_workers(self.settings.io_workers)
        if wanted:
            try:
                self._handover = handover = find_handover(self._flat)
                options = [for_worker_processes(r.spec.options) for r in self.roots]
                spec = WorkerSpec(
                    self.step_spec.with_options(options),
                    handover,
                    tuple(r.signals for r in self.roots),
                    self.pinning.cpus,
                    self.settings.io_workers_nice,
                )
                self._scheduler.start(ProcessExecutor(spec, wanted))
                return wanted
            except (NoHandover, OSError, RuntimeError) as exc:
                if self._handover is not None:
                    self._handover.close()
                    self._handover = None
                logger.warning("llmkv_fs: I/O worker processes not used (%s); using threads", exc)
        settings = self.settings
        cpus = len(self.pinning.cpus) if self.pinning.cpus else len(os.sched_getaffinity(0))
        reads, writes, self._threads_why = io_thread_counts(
            settings, [root.fstype for root in self.roots], cpus
        )
        step = build_step(
            self.step_spec,
            self._flat,
            [r.blockio for r in self.roots],
            [r.signals for r in self.roots],
            self.pause,
        )
        self._scheduler.start(
            ThreadExecutor(
                step,
                reads,
                writes,
                pin_cpus=self.pinning.cpus,
            )
        )
        return 0

    # -- owner side --------------------------------------------------------------------

    def submit_store(self, job_id: int, keys: Sequence[bytes], chunks: Sequence[int]) -> bool:
        """Queue a store; False if it was refused -- the bounded queue is
        full, the space guard is tripped, the volume is stalled or failed. A
        refused job is reported failed by the next take_finished, without I/O."""
        if self.volume_failed():
            return self._refuse(job_id, Direction.STORE, keys, Failure.VOLUME_FAILED)
        if self.stalled():
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
        if self.volume_failed():
            return self._refuse(job_id, Direction.LOAD, keys, Failure.VOLUME_FAILED)
        if self.stalled():
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

    def stalled(self) -> bool:
        """The volume stopped answering: an expired job still has a block
        inside a syscall, or a lookup batch is overdue. Clears by itself
        when the calls return."""
        self._stalled = self._scheduler.stuck_blocks() > 0 or self._lookups.stuck()
        return self._stalled

    def volume_failed(self) -> bool:
        """Every root is lost: not the directory the engine started on (as
        of each housekeeping thread's last check; never touches the
        filesystem). With several roots, the blocks of a lost root fail one
        by one in the step, and lookups of its keys answer miss."""
        lost = [index for index, root in enumerate(self.roots) if root.housekeeping.root_lost]
        self._lost_roots = frozenset(lost)
        return len(lost) == len(self.roots)

    def take_finished(self) -> list[FinishedJob]:
        if not self._rejected and not self._scheduler.has_news():
            return []  # vLLM polls every millisecond: keep the empty case cheap
        expired = self._scheduler.expire_overdue()
        if expired:
            self.stalled()
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
        lost = self._lost_roots
        refused = self._stalled or (bool(lost) and self.placement.home(key) in lost)
        verdict = False if refused else self._lookups.lookup(key, request_id)
        self.counters[_LOOKUP_ANSWER[verdict]] += 1
        return verdict

    def end_step(self) -> None:
        self._lookups.end_step()
        # Cumulative in the executor; copied here so that only the owner
        # writes counters.
        self.counters[Tally.WORKER_DEATHS] = self._executor.deaths()
        self.stalled()
        self.volume_failed()
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
        """Point-in-time state for metrics; cheap, owner side. Each root's
        own state is in ``root_gauges``."""
        return {
            "queued_store_blocks": self._scheduler.queued_store_blocks(),
            "queued_load_blocks": self._scheduler.queued_load_blocks(),
            "busy_threads": self._scheduler.blocks_in_flight(),
            "io_workers": len(self._executor.worker_pids()),
            "stuck_blocks": self._scheduler.stuck_blocks(),
        }

    def root_gauges(self) -> dict[str, dict[str, float]]:
        """Each root's state for metrics, by root_dir; cheap, owner side.
        Also refreshes the volume-failed verdict lookups read, as every
        step's metrics always have."""
        self.volume_failed()
        gauges: dict[str, dict[str, float]] = {}
        for root in self.roots:
            usage = root.guard.usage
            gauges[root.root_dir] = {
                "space_guard_tripped": 0 if root.guard.allows_store() else 1,
                "volume_failed": 1 if root.housekeeping.root_lost else 0,
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
        started = time.monotonic()
        self._lookups.shutdown()
        self._scheduler.shutdown()
        if self._handover is not None:
            self._handover.close()
        for root in self.roots:
            root.close()
        # Our view pins the primary mmap; vLLM unmaps it right after us.
        self._flat.release()
        logger.info("llmkv_fs engine stopped in %.3fs", time.monotonic() - started)
