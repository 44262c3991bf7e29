"""What the engine decides and starts once, before its first job: the keys
and namespace of sealed blocks, how many blocks a place takes at once, which
executor runs the blocks (worker processes where io_workers asks for them
and the CPU tier can be handed over, else I/O threads), and the one start-up
line that says all of it.

Threading: the engine's constructing thread, once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

import xxhash

from llmkv_fs.config import TierSettings
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.block.spec import StepSpec, build_step
from llmkv_fs.engine.roots import EngineRoot
from llmkv_fs.engine.scheduling.scheduler import BlockScheduler
from llmkv_fs.engine.startup.hash_path import xxh3_path
from llmkv_fs.engine.startup.io_setup import for_worker_processes, io_thread_counts
from llmkv_fs.engine.startup.numa import PinningPlan
from llmkv_fs.engine.threads.thread_executor import ThreadExecutor
from llmkv_fs.engine.workers.crew import WorkerSpec, resolve_io_workers
from llmkv_fs.engine.workers.process_executor import ProcessExecutor
from llmkv_fs.engine.workers.region import NoHandover, RegionHandover, find_handover
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.sealed import SCHEME, Keyring, sealed_layout
from llmkv_fs.volume.keyfiles import load_keyring

__all__ = ["Started", "log_start", "sealing", "slice_blocks", "start_executor"]

logger = logging.getLogger("vllm.llmkv_fs.engine")

# An executor place takes up to this many bytes of one job's blocks at once
# (a slice: one scheduler round trip, one record to a worker), and only while
# every place can take as many twice over (scheduling/scheduler.py): with
# work queued for all, fewer slices are fewer hand-offs under the interpreter
# lock (docs/benchmarks.md, "Small blocks" and "The slice").
_SLICE_BYTES = 4 << 20
_SLICE_MAX_BLOCKS = 64
# ... and, while a job is spread over the places, at least this many: a
# slice's own cost (its take, the compiled call, its publish: Python under
# the interpreter lock every place shares) is about what moving 256 KiB
# costs, so a small job cut finer waits on the handoffs, not on the bytes
# (docs/benchmarks.md, "A small job's latency").
_SLICE_LEAST_BYTES = 1 << 18


def slice_blocks(block_size: int) -> tuple[int, int]:
    """How many blocks of one job an executor place may take at once: the
    most, and the fewest while more are queued than that."""
    most = max(1, min(_SLICE_MAX_BLOCKS, _SLICE_BYTES // block_size))
    return most, max(1, min(most, _SLICE_LEAST_BYTES // block_size))


def sealing(
    settings: TierSettings, layouts: CacheLayout | Sequence[CacheLayout]
) -> tuple[Keyring | None, Sequence[CacheLayout]]:
    """The sealing keys (None: blocks are not sealed) and the layouts blocks
    live in: sealed ones in their own namespace, whose run config names the
    scheme (layout/sealed.py). Keys are read now, before anything touches a
    volume (TierConfigError naming the setting)."""
    if isinstance(layouts, CacheLayout):
        layouts = (layouts,)
    keyring = load_keyring(dict(settings.seal_key_files or ()), settings.seal_write_key_id)
    if keyring is not None:
        layouts = [sealed_layout(layout) for layout in layouts]
    return keyring, layouts


@dataclasses.dataclass
class Started:
    """The executor that was started, and what the engine keeps of it."""

    io_workers: int  # worker processes in use (0: I/O threads)
    handover: RegionHandover | None  # the CPU tier handed to the workers (closed at shutdown)
    description: str  # for the start-up line: what runs, and why fewer than asked


def start_executor(
    scheduler: BlockScheduler,
    settings: TierSettings,
    spec: StepSpec,
    roots: Sequence[EngineRoot],
    primary: memoryview,
    pinning: PinningPlan,
    pause: PausePoints | None,
) -> Started:
    """Start worker processes when io_workers asks for them and the
    primary can be handed over, else I/O threads (the reason logged once)."""
    wanted = resolve_io_workers(settings.io_workers)
    if wanted:
        handover = None
        try:
            handover = find_handover(primary)
            options = [for_worker_processes(r.spec.options) for r in roots]
            signals = tuple(r.signals for r in roots)
            worker_spec = WorkerSpec(
                spec.with_options(options),
                handover,
                signals,
                pinning.cpus,
                settings.io_workers_nice,
                pause,
            )
            scheduler.start(ProcessExecutor(worker_spec, wanted, primary))
            nice = settings.io_workers_nice
            return Started(wanted, handover, f"{wanted} worker processes (nice +{nice})")
        except (NoHandover, OSError, RuntimeError) as exc:
            if handover is not None:
                handover.close()
            logger.warning("llmkv_fs: I/O worker processes not used (%s); using threads", exc)
    cpus = len(pinning.cpus) if pinning.cpus else len(os.sched_getaffinity(0))
    reads, writes, why = io_thread_counts(settings, [root.fstype for root in roots], cpus)
    blockios, signals_pages = [r.blockio for r in roots], [r.signals for r in roots]
    step = build_step(spec, primary, blockios, signals_pages, pause)
    scheduler.start(ThreadExecutor(step, reads, writes, pin_cpus=pinning.cpus))
    threads = f"{reads} read + {writes} write threads{why}"
    if settings.io_workers_nice:
        threads += " (io_workers_nice applies to worker processes only: not used)"
    return Started(0, None, threads)


def log_start(
    settings: TierSettings,
    started: Started,
    pinning: PinningPlan,
    presence: str,
    keyring: Keyring | None,
    roots: Sequence[EngineRoot],
) -> None:
    """The start-up line, then sealing (key ids only: a Keyring never shows
    a key) and each root's line."""
    logger.info(
        "llmkv_fs engine: %s, durability=%s, checksum=%s (xxh3 of python-xxhash %s: %s), "
        "numa: %s, presence check %s",
        started.description,
        settings.durability,
        settings.checksum,
        xxhash.VERSION,
        xxh3_path(),
        pinning.reason,
        presence,
    )
    if keyring is not None:
        logger.info("llmkv_fs engine sealing: %s, %r", SCHEME, keyring)
    for root in roots:
        logger.info(
            "llmkv_fs engine root: %s, %s I/O",
            root.layout.rank_dir,
            "O_DIRECT" if root.use_o_direct else "buffered",
        )
