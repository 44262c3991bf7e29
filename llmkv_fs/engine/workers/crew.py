"""The worker processes of one worker executor (workers/process_executor.py): what
they are given (WorkerSpec), the handle the executor keeps for each
(WorkerHandle), the cancel board they share, and their life -- spawn, reap,
replace after a growing pause, stop -- in Crew. How many there are:
``resolve_io_workers``. The worker's own side: workers/child.py.

Threading rules
---------------
* The conductor thread alone spawns, reaps and stops workers: it spawns
  every worker, so PR_SET_PDEATHSIG (which fires when the spawning *thread*
  exits) ties workers to the executor's life. It alone writes a handle's
  fields; the owner reads ``held`` (to mark the cancel board when a job
  expires) and ``ready`` as plain loads that may be a moment stale.
* The owner reads ``Crew.pids``, ``started`` and ``died``, and marks places
  of the cancel board (see CancelBoard).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import mmap
import os
import pathlib
import pickle
import select
import selectors
import subprocess
import sys
import time
from collections.abc import Callable

from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.block.spec import StepSpec
from llmkv_fs.engine.outcomes import BlockResult
from llmkv_fs.engine.scheduling.scheduler import BlockSlice
from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.engine.workers.records import stop_record
from llmkv_fs.engine.workers.region import RegionHandover, Segment
from llmkv_fs.layout.sealed import Keyring

__all__ = [
    "DEPTH",
    "START_TIMEOUT_S",
    "CancelBoard",
    "Crew",
    "WorkerDied",
    "WorkerHandle",
    "WorkerLaunch",
    "WorkerSpec",
    "resolve_io_workers",
]

logger = logging.getLogger("vllm.llmkv_fs.workers")

DEPTH = 2  # slices a worker holds: one running, one waiting in its pipe
START_TIMEOUT_S = 120.0  # spawn, import, map the region, say hello
_RESPAWN_WARN_AFTER = 5  # replacements dead before their hello, in a row: log an error
_RESPAWN_MAX_PAUSE_S = 30.0
STOP_GRACE_S = 10.0  # shutdown waits this long for held blocks and exits, then SIGKILLs

ReadResults = Callable[["WorkerHandle", selectors.BaseSelector], bool]


class WorkerDied(Exception):
    """The worker process running this block ended before answering."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What the workers of one executor are given, built once by the engine:
    how their block step is built (``step``, with the workers' I/O options:
    startup/io_setup.py), the primary region to map, each root's shared
    signals page, the CPUs they run on, their nice increment and the
    engine's pause points (block/pause.py; None: none)."""

    step: StepSpec
    handover: RegionHandover
    signals: tuple[VolumeSignals, ...]
    cpus: frozenset[int] | None = None
    nice: int = 0
    pause: PausePoints | None = None


@dataclasses.dataclass(frozen=True)
class WorkerLaunch:
    """Everything one worker process starts from (workers/child.py), typed
    end to end: pickled onto its command line at spawn. The fds are the
    numbers the worker inherits (``pass_fds`` keeps them)."""

    step: StepSpec
    region_size: int
    segments: tuple[Segment, ...]
    region_fds: tuple[int, ...]
    signals_fds: tuple[int, ...]
    board_fd: int
    board_size: int
    jobs_fd: int
    results_fd: int
    parent: int
    cpus: tuple[int, ...] | None
    nice: int
    # The read end of a pipe holding the sealing keys (-1: not sealed): the
    # launch is on the worker's command line, which anyone on the host may
    # read, so ``step`` travels without its keyring (``keys_pipe``).
    keys_fd: int = -1
    pause: PausePoints | None = None  # the engine's pause points (block/pause.py)

    def encoded(self) -> str:
        return base64.b64encode(pickle.dumps(self, pickle.HIGHEST_PROTOCOL)).decode("ascii")

    @staticmethod
    def decoded(text: str) -> WorkerLaunch:
        launch = pickle.loads(base64.b64decode(text))
        if not isinstance(launch, WorkerLaunch):
            raise TypeError(f"not a worker launch: {type(launch).__name__}")
        return launch


def keys_pipe(keyring: Keyring | None) -> int:
    """The read end of a pipe that holds ``keyring`` and then EOF (-1: no
    keyring), for one worker to inherit: the keys reach it neither on its
    command line nor in its environment, and are gone from the pipe once
    read (workers/child.py)."""
    if keyring is None:
        return -1
    data = keyring.to_bytes()
    if len(data) > select.PIPE_BUF:  # one write that cannot block or split
        raise ValueError(f"a keyring of {len(data)} bytes does not fit one pipe write")
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        os.write(write_end, data)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return read_end


class CancelBoard:
    """One byte per worker place (``worker.index * DEPTH + slot``) in a memfd
    every worker maps: the conductor clears a place before reusing it, the
    owner sets it when the block's job passes its deadline, and the worker
    reads it before running a block and again before a store's rename."""

    def __init__(self, name: str, n_workers: int):
        self.fd = os.memfd_create(f"{name}_cancel_board", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, n_workers * DEPTH)
            self.places = mmap.mmap(self.fd, n_workers * DEPTH)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:  # once: the number may be someone else's afterwards
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(BufferError):
            self.places.close()


class WorkerHandle:
    """The executor's side of one worker process (a place in Crew.workers that
    outlives the processes it is replaced with)."""

    __slots__ = (
        "buf",
        "failed_starts",
        "got",
        "held",
        "index",
        "jobs_w",
        "load_first",
        "proc",
        "ready",
        "respawn_at",
        "results_r",
        "served",
    )

    def __init__(self, index: int, load_first: bool):
        self.index = index
        self.load_first = load_first
        self.proc: subprocess.Popen[bytes] | None = None
        self.jobs_w = -1
        self.results_r = -1
        self.ready = False
        self.held: list[BlockSlice | None] = [None] * DEPTH
        # Results of each held slice received so far, in its order.
        self.got: list[list[BlockResult]] = [[] for _ in range(DEPTH)]
        self.buf = bytearray()
        self.failed_starts = 0  # deaths before the hello, in a row
        self.served = False  # the last process in this place had said hello
        self.respawn_at: float | None = None  # a replacement is due then


class Crew:
    """The worker processes of one executor and the cancel board they share.
    See the module doc for who calls what."""

    def __init__(self, spec: WorkerSpec, n_workers: int, name: str):
        self.spec = spec
        self.board = CancelBoard(name, n_workers)
        self.workers = [WorkerHandle(i, i % 2 == 0) for i in range(n_workers)]
        self.started = 0
        self.died = 0
        # The earliest respawn_at of any worker (monotonic), None when no
        # replacement waits: read by the conductor each turn, without a call.
        self.next_respawn: float | None = None

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None and w.ready]

    def start_all(self, selector: selectors.BaseSelector, read: ReadResults) -> None:
        """Spawn every worker and wait for each one's hello (``read`` consumes
        a worker's records); raises if one cannot start."""
        for worker in self.workers:
            self.spawn(worker, selector)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(w.ready for w in self.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers not ready after {START_TIMEOUT_S:.0f}s")
            for key, _ in selector.select(left):
                if key.data is not None and not read(key.data, selector):
                    raise RuntimeError(f"worker {key.data.index} exited during start-up")

    def said_hello(self, worker: WorkerHandle) -> None:
        worker.ready = True
        worker.failed_starts = 0

    def spawn(self, worker: WorkerHandle, selector: selectors.BaseSelector) -> None:
        """Start ``worker``'s process. Whatever fails on the way (a respawn's
        fork refused, say), every descriptor opened for it is closed again."""
        jobs_r, jobs_w = os.pipe2(os.O_CLOEXEC)
        results_r = results_w = keys_fd = -1
        try:
            results_r, results_w = os.pipe2(os.O_CLOEXEC)
            spec, board = self.spec, self.board
            handover = spec.handover
            signals_fds = tuple(signals.fd for signals in spec.signals)
            inherited = (jobs_r, results_w, board.fd, *signals_fds, *handover.fds)
            keys_fd = keys_pipe(spec.step.keyring)
            launch = WorkerLaunch(
                step=spec.step.without_keys(),
                region_size=handover.size,
                segments=handover.segments,
                region_fds=tuple(handover.fds),
                signals_fds=signals_fds,
                board_fd=board.fd,
                board_size=len(board.places),
                jobs_fd=jobs_r,
                results_fd=results_w,
                parent=os.getpid(),
                cpus=tuple(sorted(spec.cpus)) if spec.cpus else None,
                nice=spec.nice,
                keys_fd=keys_fd,
                pause=spec.pause,
            )
            worker.proc = _start_child(launch, (*inherited, keys_fd))
        except BaseException:
            for fd in (jobs_w, results_r):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (jobs_r, results_w, keys_fd):
                if fd >= 0:
                    os.close(fd)
        worker.jobs_w, worker.results_r = jobs_w, results_r
        worker.ready = False
        worker.buf = bytearray()
        for slot in range(DEPTH):
            board.places[worker.index * DEPTH + slot] = 0
        selector.register(results_r, selectors.EVENT_READ, worker)
        worker.respawn_at = None
        self._respawns_changed()
        self.started += 1

    def _respawns_changed(self) -> None:
        due = [w.respawn_at for w in self.workers if w.respawn_at is not None]
        self.next_respawn = min(due) if due else None

    def respawn_due(self, selector: selectors.BaseSelector) -> None:
        """Start the replacements due by now (the conductor calls this once
        ``next_respawn`` has passed)."""
        now = time.monotonic()
        for worker in self.workers:
            if worker.respawn_at is not None and worker.respawn_at <= now:
                try:
                    self.spawn(worker, selector)
                except OSError as exc:
                    logger.warning("llmkv_fs: could not start an I/O worker: %r", exc)
                    worker.served = False
                    self._schedule_respawn(worker)

    def _schedule_respawn(self, worker: WorkerHandle) -> None:
        """Replace at once after a worker that had served; after one that
        died before its hello, wait 0.1 s doubling to 30 s (a replacement
        that cannot start -- a broken interpreter -- once restarted 523
        times in 4 s, burning a core)."""
        worker.failed_starts += 1 if not worker.served else 0
        pause = (
            0.0
            if worker.served
            else min(_RESPAWN_MAX_PAUSE_S, 0.1 * 2 ** (worker.failed_starts - 1))
        )
        if worker.failed_starts == _RESPAWN_WARN_AFTER:
            logger.error(
                "llmkv_fs: I/O worker %d died %d times in a row before it was ready; "
                "retrying every %.0fs at most (its blocks wait or pass their deadline)",
                worker.index,
                worker.failed_starts,
                _RESPAWN_MAX_PAUSE_S,
            )
        worker.respawn_at = time.monotonic() + pause
        self._respawns_changed()

    def reap(self, worker: WorkerHandle, selector: selectors.BaseSelector, replace: bool) -> str:
        """A worker ended unasked: close its pipes, kill and reap its
        process, count the death, schedule a replacement (``replace``).
        Returns why its blocks are lost (they are still in ``held``)."""
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
        worker.served, worker.ready = worker.ready, False
        held = sum(h.n_blocks for h in worker.held if h is not None)
        self.died += 1
        logger.warning(
            "llmkv_fs: I/O worker %d (pid %s) ended with status %s holding %d block(s)%s%s",
            worker.index,
            proc.pid if proc else "?",
            status,
            held,
            "" if worker.served else " before it was ready",
            "; starting a replacement" if replace else "",
        )
        if replace:
            self._schedule_respawn(worker)
        return f"I/O worker pid {proc.pid if proc else '?'} exited ({status})"

    def stop(self, selector: selectors.BaseSelector, grace_s: float) -> None:
        """Send every worker STOP, wait for it up to ``grace_s`` in all
        (SIGKILL after), close its pipes. Idempotent."""
        self.next_respawn = None
        for worker in self.workers:
            worker.respawn_at = None
            if worker.jobs_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(worker.jobs_w, stop_record())
                with contextlib.suppress(OSError):
                    os.close(worker.jobs_w)
                worker.jobs_w = -1
        deadline = time.monotonic() + grace_s
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


# io_workers=auto: worker processes only from this many CPUs (below it they
# do not beat I/O threads: docs/benchmarks.md); two CPUs stay for vLLM's
# scheduler and the conductor thread.
AUTO_MIN_CPUS = 6
AUTO_MAX_WORKERS = 16


def resolve_io_workers(setting: str | int, cpus: int | None = None) -> int:
    """The number of worker processes ``io_workers`` asks for (0: threads)."""
    if setting != "auto":
        return int(setting)
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    return 0 if cpus < AUTO_MIN_CPUS else min(AUTO_MAX_WORKERS, cpus - 2)


def _start_child(launch: WorkerLaunch, fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
    """The worker process for ``launch``, inheriting ``fds`` (-1: none)."""
    # llmkv_fs/engine/workers/crew.py -> the directory holding llmkv_fs
    package_root = str(pathlib.Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            # -c puts the current directory first on sys.path: a checkout of
            # another llmkv_fs there would be imported instead of the
            # engine's (python -P is 3.11+ only).
            "import os, sys; os.umask(0); "
            "sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]; "
            "from llmkv_fs.engine.workers.child import main; main()",
            launch.encoded(),
        ],
        pass_fds=tuple(fd for fd in fds if fd >= 0),
        stdin=subprocess.DEVNULL,
        env=env,
    )
