"""The worker processes of one ProcPool (procpool.py): what they are given
(WorkerSpec), the handle the pool keeps for each (WorkerHandle), the cancel
board they share, and their life -- spawn, reap, replace, stop -- in Crew.
How many there are: ``resolve_io_workers``. The worker's own side: worker.py.

Threading rules
---------------
* The conductor thread alone spawns, reaps and stops workers: it spawns
  every worker, so PR_SET_PDEATHSIG (which fires when the spawning *thread*
  exits) ties workers to the pool's life. It alone touches a handle's pipes,
  process and ``buf``; ``held`` and ``ready`` it changes under the pool lock
  or (``ready``) as a plain store the owner may read a moment late.
* The owner reads ``Crew.pids``, ``started`` and ``died``, and marks places
  of the cancel board (see CancelBoard).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import pathlib
import selectors
import subprocess
import sys
import time
from collections.abc import Collection

from llmkv_fs.engine.block.blockio import IoOptions
from llmkv_fs.engine.threads.pool import IoJob
from llmkv_fs.engine.workers.records import JOB, OP_STOP
from llmkv_fs.engine.workers.region import RegionHandover
from llmkv_fs.layout.paths import CacheLayout

__all__ = [
    "DEPTH",
    "START_TIMEOUT_S",
    "CancelBoard",
    "Crew",
    "WorkerDied",
    "WorkerHandle",
    "WorkerSpec",
    "resolve_io_workers",
]

logger = logging.getLogger("vllm.llmkv_fs.procpool")

DEPTH = 2  # blocks a worker holds: one running, one waiting in its pipe
START_TIMEOUT_S = 120.0  # spawn, import, map the region, say hello
_RESPAWN_LIMIT = 5  # replacements that die before saying hello, in a row
_STOP_GRACE_S = 10.0

HeldBlock = tuple[IoJob, int]  # (job, block index) a worker place holds


class WorkerDied(Exception):
    """The worker process running this block ended before answering."""


class WorkerSpec:
    """What a worker needs besides its fds: JSON-able, built once."""

    def __init__(
        self,
        handover: RegionHandover,
        layout: CacheLayout,
        options: IoOptions,
        cpus: Collection[int] | None,
    ):
        self.handover = handover
        self.common = {
            "size": handover.size,
            "segments": [
                (s.offset, s.length, s.file_offset, s.fd_index) for s in handover.segments
            ],
            "root_dir": layout.root_dir,
            "run_config": layout.run_config,
            "rank": layout.rank,
            "options": {
                k: getattr(options, k) for k in options.__dataclass_fields__ if k != "root"
            },
            # The pinned root travels as (path, dev, ino): a worker refuses to
            # create directories once the volume underneath is not that one.
            "root": None if options.root is None else [options.root.path, *options.root.ident],
            "cpus": sorted(cpus) if cpus else None,
        }


class CancelBoard:
    """One byte per worker place (``worker.index * DEPTH + slot``) in a memfd
    every worker maps: the conductor clears a place before reusing it, the
    owner sets it when the block's job passes its deadline, and the worker
    reads it before running a block and again before a store's rename."""

    def __init__(self, name: str, n_workers: int):
        self.fd = os.memfd_create(f"{name}_cancel_board", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, n_workers * DEPTH)
        self.places = mmap.mmap(self.fd, n_workers * DEPTH)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(BufferError):
            self.places.close()


class WorkerHandle:
    """The pool's side of one worker process (a place in Crew.workers that
    outlives the processes it is replaced with)."""

    __slots__ = ("buf", "held", "index", "jobs_w", "load_first", "proc", "ready", "results_r")

    def __init__(self, index: int, load_first: bool):
        self.index = index
        self.load_first = load_first
        self.proc: subprocess.Popen[bytes] | None = None
        self.jobs_w = -1
        self.results_r = -1
        self.ready = False
        self.held: list[HeldBlock | None] = [None] * DEPTH
        self.buf = bytearray()


class Crew:
    """The worker processes of one pool and the cancel board they share.
    See the module doc for who calls what."""

    def __init__(self, spec: WorkerSpec, n_workers: int, name: str):
        self.spec = spec
        self.board = CancelBoard(name, n_workers)
        self.workers = [WorkerHandle(i, i % 2 == 0) for i in range(n_workers)]
        self.started = 0
        self.died = 0

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None and w.ready]

    def spawn(self, worker: WorkerHandle, selector: selectors.BaseSelector) -> None:
        jobs_r, jobs_w = os.pipe2(os.O_CLOEXEC)
        results_r, results_w = os.pipe2(os.O_CLOEXEC)
        handover = self.spec.handover
        board = self.board
        spec = dict(
            self.spec.common,
            parent=os.getpid(),
            jobs_fd=jobs_r,
            results_fd=results_w,
            region_fds=handover.fds,
            board_fd=board.fd,
            board_size=len(board.places),
        )
        # llmkv_fs/engine/workers/crew.py -> the directory holding llmkv_fs
        package_root = str(pathlib.Path(__file__).resolve().parents[3])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            worker.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import os; os.umask(0); from llmkv_fs.engine.workers.child import main; main()",
                    json.dumps(spec),
                ],
                pass_fds=(jobs_r, results_w, board.fd, *handover.fds),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            os.close(jobs_r)
            os.close(results_w)
        worker.jobs_w, worker.results_r = jobs_w, results_r
        worker.ready = False
        worker.buf = bytearray()
        for slot in range(DEPTH):
            board.places[worker.index * DEPTH + slot] = 0
        selector.register(results_r, selectors.EVENT_READ, worker)
        self.started += 1

    def respawn(self, worker: WorkerHandle, selector: selectors.BaseSelector) -> None:
        for _attempt in range(_RESPAWN_LIMIT):
            try:
                self.spawn(worker, selector)
                return
            except OSError as exc:
                logger.warning("llmkv_fs: could not start an I/O worker: %r", exc)
        logger.error("llmkv_fs: I/O worker %d could not be replaced", worker.index)

    def reap(
        self, worker: WorkerHandle, selector: selectors.BaseSelector, replacing: bool
    ) -> tuple[list[tuple[int, HeldBlock]], str]:
        """Close a worker's pipes, kill and reap its process. Returns the
        blocks it held, by slot (still in ``held``: the caller fails them
        under the pool lock), and why they are lost."""
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(worker.results_r)
        for fd in (worker.jobs_w, worker.results_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        worker.jobs_w = worker.results_r = -1
        proc, worker.proc = worker.proc, None
        status = None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            status = proc.wait()
        was_ready, worker.ready = worker.ready, False
        lost = [(i, h) for i, h in enumerate(worker.held) if h is not None]
        if lost or was_ready:
            self.died += 1
            logger.warning(
                "llmkv_fs: I/O worker %d (pid %s) ended with status %s holding %d block(s)%s",
                worker.index,
                proc.pid if proc else "?",
                status,
                len(lost),
                "; starting a replacement" if replacing else "",
            )
        return lost, f"I/O worker pid {proc.pid if proc else '?'} exited ({status})"

    def stop(self, selector: selectors.BaseSelector) -> None:
        """Send every worker STOP, wait for it (SIGKILL after a grace), close
        its pipes."""
        for worker in self.workers:
            if worker.jobs_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(worker.jobs_w, JOB.pack(OP_STOP, 0, 0, 0))
                with contextlib.suppress(OSError):
                    os.close(worker.jobs_w)
                worker.jobs_w = -1
        deadline = time.monotonic() + _STOP_GRACE_S
        for worker in self.workers:
            proc, worker.proc = worker.proc, None
            if proc is not None:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if worker.results_r >= 0:
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(worker.results_r)
                with contextlib.suppress(OSError):
                    os.close(worker.results_r)
                worker.results_r = -1
            worker.ready = False


# io_workers=auto: on 2 cores worker processes were at parity with threads
# or below (issue 12's prototype); two CPUs stay for vLLM's scheduler and
# the conductor thread.
AUTO_MIN_CPUS = 6
AUTO_MAX_WORKERS = 16


def resolve_io_workers(setting: str | int, cpus: int | None = None) -> int:
    """The number of worker processes ``io_workers`` asks for (0: threads)."""
    if setting != "auto":
        return int(setting)
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    return 0 if cpus < AUTO_MIN_CPUS else min(AUTO_MAX_WORKERS, cpus - 2)
