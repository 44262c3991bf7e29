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
import time
from collections.abc import Sequence

from llmkv_fs.config import TierSettings
from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.io_setup import choose_o_direct, io_options, rows_view
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.block.step import BlockStep
from llmkv_fs.engine.lookup import AsyncExistence
from llmkv_fs.engine.outcomes import CounterKey, Direction, Failure, LookupAnswer, Tally
from llmkv_fs.engine.scheduling.accounting import FinishedJob, JobAccountant, ThrottledErrorLog
from llmkv_fs.engine.scheduling.executor import Executor
from llmkv_fs.engine.scheduling.jobs import IoJob, QueueFull
from llmkv_fs.engine.scheduling.scheduler import BlockScheduler
from llmkv_fs.engine.threads.executor import ThreadExecutor
from llmkv_fs.engine.volume.housekeeping import Housekeeping
from llmkv_fs.engine.volume.numa import PinningPlan, plan_pinning, read_topology
from llmkv_fs.engine.volume.prepare import EngineError, prepare_volume
from llmkv_fs.engine.volume.signals import VolumeSignals
from llmkv_fs.engine.volume.space import SpaceGuard
from llmkv_fs.engine.workers.crew import WorkerSpec, resolve_io_workers
from llmkv_fs.engine.workers.executor import ProcessExecutor
from llmkv_fs.engine.workers.region import NoHandover, RegionHandover, find_handover
from llmkv_fs.layout.blockfile import Buffer
from llmkv_fs.layout.files import PinnedRoot
from llmkv_fs.layout.fsinfo import filesystem_type
from llmkv_fs.layout.leases import Lease
from llmkv_fs.layout.paths import CacheLayout

__all__ = ["EngineError", "FinishedJob", "FsEngine"]

logger = logging.getLogger("vllm.llmkv_fs.engine")


_LOOKUP_ANSWER = {True: LookupAnswer.HIT, False: LookupAnswer.MISS, None: LookupAnswer.RETRY}
# Lookups are one metadata call each; one that waits this long (or the job
# deadline, if shorter) means the volume is not answering.
_LOOKUP_TIMEOUT_CAP_S = 5.0


class FsEngine:
    """The engine of one tier instance on one volume directory.

    Constructing it prepares the volume first (``prepare_volume``: the root is
    checked, ``config.json`` created or verified, the rank directory made), so
    no I/O thread ever starts on an unchecked volume. Raises EngineError (or
    RunConfigMismatch) with the path and the fix; VolumeError (an OSError) for
    an unusable root.

    Volume failed: while root_dir is not the directory the engine started on
    (the housekeeping thread re-checks it about once a second), stores and
    loads are refused at submit (``Failure.VOLUME_FAILED``), lookups answer
    miss and nothing is created on the volume; it clears by itself when the
    directory is back.
    """

    def __init__(
        self,
        settings: TierSettings,
        layout: CacheLayout,
        primary: Buffer,
        block_size: int,
    ):
        prepared = prepare_volume(
            layout, settings.file_mode, settings.dir_mode, settings.require_mounted_root
        )
        # "created", "matched" or "repaired": what became of config.json.
        self.run_config_state = prepared.run_config_state
        self.settings = settings
        self.layout = layout
        self.block_size = block_size
        self._flat = rows_view(primary, block_size)
        self.num_chunks = self._flat.nbytes // block_size
        self.use_o_direct = choose_o_direct(
            settings.io_mode, self._flat, block_size, layout.rank_dir
        )
        self.pinning: PinningPlan = plan_pinning(read_topology(), settings.numa_node, self._flat)
        fstype = filesystem_type(layout.root_dir)
        self.blockio = BlockIO(
            layout,
            io_options(settings, block_size, self.use_o_direct, fstype, prepared.root),
        )
        # Cumulative, updated by the owner only; tier/metrics.py publishes them.
        self.counters: collections.Counter[CounterKey] = collections.Counter()
        self.signals = VolumeSignals.create()
        self.guard, self.housekeeping = self._start_housekeeping(prepared.root)
        self._error_log = ThrottledErrorLog()
        self._rejected: list[FinishedJob] = []
        self._stalled = False  # as of the last stalled() (lookups read this)
        self._volume_failed = False  # as of the last end_step() (lookups read this)
        self._handover: RegionHandover | None = None
        self.step = BlockStep(self.blockio, self._flat, self.guard, PausePoints.from_environment())
        self._scheduler = BlockScheduler(settings.max_pending_store_blocks)
        self.io_workers = self._start_executor()  # worker processes in use (0: I/O threads)
        self._executor: Executor = self._scheduler.executor
        # Every block the executor can hold may start a store the moment the
        # guard lifts after ENOSPC.
        self.guard.headroom_bytes = block_size * (self._executor.capacity() + 1)
        self._lookups = AsyncExistence(
            self.blockio.exists,
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

    def _start_housekeeping(self, root: PinnedRoot) -> tuple[SpaceGuard, Housekeeping]:
        settings, layout = self.settings, self.layout
        guard = SpaceGuard(
            layout.root_dir,
            settings.max_usage_percent,
            settings.min_free_bytes,
            headroom_bytes=0,  # set once the executor exists (the blocks it holds)
            signals=self.signals,
        )
        housekeeping = Housekeeping(
            guard,
            layout.base_path,
            settings.lease_interval_s,
            settings.file_mode,
            settings.dir_mode,
            stamp=self.blockio.apply_access_stamps,
            root=root,
        )
        return guard, housekeeping

    def _log_start(self) -> None:
        settings = self.settings
        logger.info(
            "llmkv_fs engine: %s, %s I/O, %s, durability=%s, checksum=%s, numa: %s",
            self.layout.rank_dir,
            "O_DIRECT" if self.use_o_direct else "buffered",
            f"{self.io_workers} worker processes"
            if self.io_workers
            else f"{settings.n_read_threads} read + {settings.n_write_threads} write threads",
            settings.durability,
            settings.checksum,
            self.pinning.reason,
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
                spec = WorkerSpec(
                    handover, self.layout, self.blockio.options, self.pinning.cpus, self.signals
                )
                self._scheduler.start(ProcessExecutor(spec, wanted))
                return wanted
            except (NoHandover, OSError, RuntimeError) as exc:
                if self._handover is not None:
                    self._handover.close()
                    self._handover = None
                logger.warning("llmkv_fs: I/O worker processes not used (%s); using threads", exc)
        settings = self.settings
        self._scheduler.start(
            ThreadExecutor(
                self.step,
                settings.n_read_threads,
                settings.n_write_threads,
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
        if not self.guard.allows_store():
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
        """root_dir is not the directory the engine started on (as of the
        housekeeping thread's last check; never touches the filesystem)."""
        self._volume_failed = self.housekeeping.root_lost
        return self._volume_failed

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
        for result in results:
            if result.is_load:
                self._lookups.set_verdict(result.failed, False)
            else:
                self._lookups.set_verdict(result.succeeded, True)
        return results

    def lookup(self, key: bytes, request_id: str) -> bool | None:
        # The step's cached verdict: a per-key clock read would cost more
        # than the lookup itself, and a stall is detected per step anyway.
        refused = self._stalled or self._volume_failed
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
        self.housekeeping.set_lease(lease)

    def gauges(self) -> dict[str, float]:
        """Point-in-time state for metrics; cheap, owner side."""
        usage = self.guard.usage
        return {
            "queued_store_blocks": self._scheduler.queued_store_blocks(),
            "queued_load_blocks": self._scheduler.queued_load_blocks(),
            "busy_threads": self._scheduler.blocks_in_flight(),
            "io_workers": len(self._executor.worker_pids()),
            "stuck_blocks": self._scheduler.stuck_blocks(),
            "space_guard_tripped": 0 if self.guard.allows_store() else 1,
            "volume_failed": 1 if self.volume_failed() else 0,
            "volume_used_bytes": usage.used_bytes if usage else 0,
            "volume_free_bytes": usage.free_bytes if usage else 0,
        }

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
        self.housekeeping.stop()
        self.signals.close()
        # Our view pins the primary mmap; vLLM unmaps it right after us.
        self._flat.release()
        logger.info("llmkv_fs engine stopped in %.3fs", time.monotonic() - started)
