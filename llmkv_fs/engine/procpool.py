"""The I/O pool in worker processes: the same interface as pool.IoPool, but
each block runs in a worker process (worker.py) that maps the primary region
itself, so the per-block Python no longer shares vLLM's GIL.

Roles
-----
* The owner (vLLM's scheduler side) calls ``submit``, ``take_finished``,
  ``has_news``, ``expire_overdue``: they append to or pop from deques under
  a short lock, and ``submit`` writes 8 bytes to an eventfd. They never wait
  on a worker.
* One conductor thread moves records: it gives each ready worker up to
  ``_DEPTH`` blocks (one running, one waiting in its pipe, so a worker never
  idles between blocks), reads result records, fills ``job.outcomes`` and
  queues finished jobs. It spawns every worker, so PR_SET_PDEATHSIG (which
  fires when the spawning *thread* exits) ties workers to the pool's life.
* Workers: see worker.py.

Records (struct-packed, little-endian): a job record is ``JOB`` + the key; a
result record is ``RESULT`` + an optional UTF-8 text (error message, or
detail and quarantine path). ``slot`` names one of the worker's ``_DEPTH``
places in the shared cancel board (one byte per place, a memfd all workers
map): the conductor clears it before reusing the place, the owner sets it
when the block's job passes its deadline.

Guarantees (as pool.IoPool's module doc, plus):
* A store past its deadline is reported at once; its blocks in workers see
  the cancel byte before starting or before the rename (Abandoned): never
  published. A load past its deadline is reported when every block a
  worker holds came back -- or its worker died -- so nothing can still
  write its rows.
* A worker that dies (crash, SIGKILL, OOM) fails exactly the blocks it held
  (Failure.ERROR, WorkerDied), is replaced, and the pool keeps serving. A
  store it was writing leaves at most a temp file named after its pid
  (gc removes it once the pid is gone); the final name is only ever renamed
  into place whole.
* A LOAD job stops at its first failed block: blocks after it that no worker
  has taken are failed unread (vLLM cannot use a prefix with a hole).
* ``shutdown`` cancels queued blocks, lets held blocks finish, stops and
  reaps every worker, and closes every fd: no process is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import mmap
import os
import selectors
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection

from llmkv_fs.engine.blockio import IoOptions
from llmkv_fs.engine.outcomes import (
    CANCELLED,
    DEADLINE,
    SKIPPED,
    Abandoned,
    BlockMissing,
    BlockResult,
    Failed,
    Failure,
    Outcome,
    failed,
)
from llmkv_fs.engine.pool import IoJob, QueueFull
from llmkv_fs.engine.region import RegionHandover
from llmkv_fs.layout.blockfile import BlockFileError, Corruption
from llmkv_fs.layout.paths import CacheLayout

__all__ = ["JOB", "RESULT", "ProcPool", "WorkerDied", "WorkerSpec", "resolve_io_workers"]

logger = logging.getLogger("vllm.llmkv_fs.procpool")

# op u8, slot u16, chunk u32, key length u16 (then the key)
JOB = struct.Struct("<BHIH")
# slot u16, kind u8, extra u8 (corruption code), errno i32 (pid for HELLO), text length u32
RESULT = struct.Struct("<HBBiI")
OP_LOAD, OP_STORE, OP_STOP = 1, 2, 3
OUTCOME_CODES = (Outcome.WRITTEN, Outcome.PRESENT, Outcome.VERIFIED, Outcome.UNVERIFIED)
CORRUPTION_CODES = tuple(Corruption)
RESULT_MISSING, RESULT_CORRUPT, RESULT_ABANDONED = 10, 11, 12
RESULT_OSERROR, RESULT_ERROR, RESULT_CANCELLED, RESULT_HELLO = 13, 14, 15, 16

_DEPTH = 2  # blocks a worker holds: one running, one waiting in its pipe
_START_TIMEOUT_S = 120.0
_RESPAWN_LIMIT = 5  # replacements that die before saying hello, in a row
_STOP_GRACE_S = 10.0
# Blocks after a LOAD job's first failure that no worker took: not read
# (the same result pool.IoPool gives them).
NOT_LOADED = SKIPPED


# The owner wakes the conductor with a write that keeps the GIL (a PyDLL call
# does not release it; os.eventfd_write does): releasing it would hand the
# GIL to the conductor it just woke and make the owner wait for it back --
# measured on 2 cores, up to ~190 us per submitted block.
_write_holding_gil = ctypes.PyDLL(None).write
_write_holding_gil.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_write_holding_gil.restype = ctypes.c_ssize_t
_ONE = ctypes.byref(ctypes.c_uint64(1))


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


class _Worker:
    __slots__ = ("buf", "held", "index", "jobs_w", "load_first", "proc", "ready", "results_r")

    def __init__(self, index: int, load_first: bool):
        self.index = index
        self.load_first = load_first
        self.proc: subprocess.Popen[bytes] | None = None
        self.jobs_w = -1
        self.results_r = -1
        self.ready = False
        self.held: list[tuple[IoJob, int] | None] = [None] * _DEPTH
        self.buf = bytearray()


def _decode(kind: int, extra: int, err: int, text: str) -> BlockResult:
    if kind < len(OUTCOME_CODES):
        return OUTCOME_CODES[kind]
    if kind == RESULT_CANCELLED:
        return DEADLINE
    if kind == RESULT_MISSING:
        return failed(BlockMissing(text))
    if kind == RESULT_ABANDONED:
        return failed(Abandoned(text))
    if kind == RESULT_CORRUPT:
        detail, _, moved = text.partition("\0")
        exc = BlockFileError(CORRUPTION_CODES[extra], detail.split(": ", 1)[-1])
        exc.quarantined_to = moved or None
        return failed(exc)
    if kind == RESULT_OSERROR:
        message, _, filename = text.partition("\0")
        return failed(OSError(err, message, filename or None))
    return failed(RuntimeError(text))


class ProcPool:
    """See the module doc. Construction blocks until every worker mapped the
    region and said hello; it raises OSError/RuntimeError if they cannot
    (the engine then falls back to threads)."""

    def __init__(
        self,
        spec: WorkerSpec,
        n_workers: int,
        max_queued_store_blocks: int,
        admit_store: Callable[[], None],
        note_error: Callable[[BaseException], None],
        name: str = "llmkv_fs",
    ):
        self._spec = spec
        self._admit_store = admit_store
        self._note_error = note_error
        self._max_queued_stores = max_queued_store_blocks
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._loads: collections.deque[IoJob] = collections.deque()
        self._stores: collections.deque[IoJob] = collections.deque()
        # Jobs submitted but not yet moved to _loads/_stores by the conductor:
        # submit only appends (no lock: the owner never queues behind the
        # conductor, which may be waiting for the GIL while holding the lock).
        self._incoming: collections.deque[IoJob] = collections.deque()
        # Queued blocks and unfinished jobs as differences of counters that
        # each have one writer: "in" by the owner's submit, "out" under the
        # pool lock. A read may be a moment stale; the store bound is a bound.
        self._blocks_in = {True: 0, False: 0}
        self._blocks_out = {True: 0, False: 0}
        self._jobs_in = 0
        self._jobs_out = 0
        self._conductor_idle = False  # asleep in select: submit must wake it
        self._finished: collections.deque[IoJob] = collections.deque()
        self._watched: collections.deque[IoJob] = collections.deque()
        self._stuck = 0
        self._stopping = False
        self._held_blocks = 0
        self.workers_started = 0
        self.workers_died = 0
        self._board_fd = os.memfd_create(f"{name}_cancel_board", os.MFD_CLOEXEC)
        os.ftruncate(self._board_fd, n_workers * _DEPTH)
        self._board = mmap.mmap(self._board_fd, n_workers * _DEPTH)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._workers = [_Worker(i, i % 2 == 0) for i in range(n_workers)]
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._conductor = threading.Thread(
            target=self._conduct, name=f"{name}_conductor", daemon=True
        )
        self._conductor.start()
        if not self._started.wait(_START_TIMEOUT_S) or self._start_error is not None:
            self.shutdown()
            raise RuntimeError(f"I/O workers did not start: {self._start_error!r}")

    # -- owner side (same contract as IoPool) ----------------------------------

    def submit(self, job: IoJob) -> None:
        """Queue every block of ``job`` (owner thread only). Raises QueueFull
        (nothing queued) for a store job that does not fit, and RuntimeError
        after shutdown. Takes no lock and makes no syscall unless the
        conductor sleeps (measured on 2 cores: a lock shared with the
        conductor made submit cost ~180 us per block in GIL hand-offs)."""
        n = len(job.keys)
        if self._stopping:
            raise RuntimeError("llmkv_fs I/O pool is shut down")
        if not n:
            job.reported = True
            self._finished.append(job)
            return
        if not job.is_load:
            queued = self.queued_store_blocks()
            if queued and queued + n > self._max_queued_stores:
                raise QueueFull(job.job_id)
        self._blocks_in[job.is_load] += n
        self._jobs_in += 1
        if job.deadline is not None:
            self._watched.append(job)
        self._incoming.append(job)
        if self._conductor_idle:
            _write_holding_gil(self._wake, _ONE, 8)

    def has_news(self) -> bool:
        if self._finished:
            return True
        watched = self._watched
        if not watched:
            return False
        first = watched[0]
        return first.reported or (first.deadline is not None and first.deadline <= time.monotonic())

    def take_finished(self) -> list[IoJob]:
        finished = []
        while self._finished:
            finished.append(self._finished.popleft())
        return finished

    def queued_store_blocks(self) -> int:
        return self._blocks_in[False] - self._blocks_out[False]

    def queued_load_blocks(self) -> int:
        return self._blocks_in[True] - self._blocks_out[True]

    def busy_threads(self) -> int:
        return self._held_blocks

    def stuck_blocks(self) -> int:
        return self._stuck

    def busy(self) -> bool:
        return self._jobs_in > self._jobs_out or bool(self._finished)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None and w.ready]

    def expire_overdue(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        failed_blocks = 0
        while self._watched:
            job = self._watched[0]
            if job.reported:
                self._watched.popleft()
                continue
            if job.deadline is None or job.deadline > now:
                break
            self._watched.popleft()
            failed_blocks += self._expire(job)
        return failed_blocks

    def _expire(self, job: IoJob) -> int:
        with self._cond:
            queued = self._unqueue(job)
            for worker in self._workers:
                for slot, held in enumerate(worker.held):
                    if held is not None and held[0] is job:
                        self._board[worker.index * _DEPTH + slot] = 1
            with job._lock:
                job.expired = True
                in_flight = job.running
                self._stuck += in_flight
                report = job._fail(queued, DEADLINE, all_unfinished=not job.is_load)
            if report:
                self._publish(job)
        return len(queued) + (0 if job.is_load else in_flight)

    def _unqueue(self, job: IoJob) -> range:
        """Take ``job``'s untaken blocks off the queues (pool lock held)."""
        queued = range(job.next_block, len(job.keys))
        if queued:
            if job.next_block or not self._remove(self._incoming, job):
                self._remove(self._loads if job.is_load else self._stores, job)
            self._blocks_out[job.is_load] += len(queued)
            job.next_block = len(job.keys)
        return queued

    @staticmethod
    def _remove(queue: collections.deque[IoJob], job: IoJob) -> bool:
        try:
            queue.remove(job)
            return True
        except ValueError:
            return False

    def _admit_incoming(self) -> None:
        """Move submitted jobs onto the priority queues (pool lock held)."""
        while self._incoming:
            job = self._incoming.popleft()
            (self._loads if job.is_load else self._stores).append(job)

    def drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._jobs_in == self._jobs_out)

    def shutdown(self) -> None:
        self._cancel_queued()
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake, 1)
        if self._conductor.ident != threading.get_ident():
            self._conductor.join()
        for fd in (self._wake, self._board_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(BufferError):
            self._board.close()

    def _cancel_queued(self) -> None:
        """Stop taking blocks; fail every queued one as CANCELLED."""
        with self._cond:
            self._stopping = True
            for job in [*self._incoming, *self._loads, *self._stores]:
                indices = self._unqueue(job)
                with job._lock:
                    if job._fail(indices, CANCELLED):
                        self._publish(job)

    # -- conductor ---------------------------------------------------------------

    def _conduct(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake, selectors.EVENT_READ, None)
        try:
            for worker in self._workers:
                self._spawn(worker, selector)
            self._await_hellos(selector)
        except BaseException as exc:  # reported to the constructor
            self._start_error = exc
            self._started.set()
            self._stop_workers(selector)
            return
        self._started.set()
        try:
            self._serve(selector)
        except BaseException:  # never dies silently: fail everything, stop
            logger.exception("llmkv_fs: the I/O conductor failed; stopping the worker pool")
            self._cancel_queued()
            for worker in self._workers:
                self._worker_gone(worker, selector, respawn=False)
        finally:
            self._stop_workers(selector)
            selector.close()

    def _serve(self, selector: selectors.BaseSelector) -> None:
        while True:
            with self._cond:
                self._admit_incoming()
                writes = self._dispatch()
                if self._stopping and self._held_blocks == 0:
                    return
            for fd, record in writes:  # outside the lock: a write releases the GIL
                with contextlib.suppress(OSError):  # a dead worker: its EOF fails them
                    os.write(fd, record)
            self._conductor_idle = True
            if self._incoming:  # submitted after the admit: no wake-up was sent
                self._conductor_idle = False
                continue
            events = selector.select()
            self._conductor_idle = False
            for key, _ in events:
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wake)
                else:
                    self._read_results(key.data, selector)

    def _await_hellos(self, selector: selectors.BaseSelector) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all(w.ready for w in self._workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers not ready after {_START_TIMEOUT_S:.0f}s")
            for key, _ in selector.select(left):
                if key.data is not None and not self._read_results(key.data, selector, start=True):
                    raise RuntimeError(f"worker {key.data.index} exited during start-up")

    def _spawn(self, worker: _Worker, selector: selectors.BaseSelector) -> None:
        jobs_r, jobs_w = os.pipe2(os.O_CLOEXEC)
        results_r, results_w = os.pipe2(os.O_CLOEXEC)
        handover = self._spec.handover
        spec = dict(
            self._spec.common,
            parent=os.getpid(),
            jobs_fd=jobs_r,
            results_fd=results_w,
            region_fds=handover.fds,
            board_fd=self._board_fd,
            board_size=len(self._board),
        )
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            worker.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import os; os.umask(0); from llmkv_fs.engine.worker import main; main()",
                    json.dumps(spec),
                ],
                pass_fds=(jobs_r, results_w, self._board_fd, *handover.fds),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            os.close(jobs_r)
            os.close(results_w)
        worker.jobs_w, worker.results_r = jobs_w, results_r
        worker.ready = False
        worker.buf = bytearray()
        for slot in range(_DEPTH):
            self._board[worker.index * _DEPTH + slot] = 0
        selector.register(results_r, selectors.EVENT_READ, worker)
        self.workers_started += 1

    def _dispatch(self) -> list[tuple[int, bytes]]:
        """Give every ready worker blocks up to _DEPTH (pool lock held).
        Returns the records to write, after the lock is released."""
        writes: list[tuple[int, bytes]] = []
        for worker in self._workers:
            if not worker.ready:
                continue
            for slot, held in enumerate(worker.held):
                if held is not None:
                    continue
                first, second = (
                    (self._loads, self._stores)
                    if worker.load_first
                    else (self._stores, self._loads)
                )
                queue = first if first else second
                if not queue:
                    return writes
                job = queue[0]
                index = job.next_block
                job.next_block = index + 1
                if job.next_block == len(job.keys):
                    queue.popleft()
                self._blocks_out[job.is_load] += 1
                if not job.is_load:
                    try:
                        self._admit_store()
                    except Exception as exc:
                        self._finish_block(job, index, failed(exc))
                        continue
                with job._lock:
                    job.running += 1
                    if job.first_start is None:
                        job.first_start = time.monotonic()
                chunk = job.chunks[index]
                key = job.keys[index]
                board_slot = worker.index * _DEPTH + slot
                self._board[board_slot] = 0
                worker.held[slot] = (job, index)
                self._held_blocks += 1
                op = OP_LOAD if job.is_load else OP_STORE
                writes.append((worker.jobs_w, JOB.pack(op, board_slot, chunk, len(key)) + key))
        return writes

    def _read_results(
        self, worker: _Worker, selector: selectors.BaseSelector, start: bool = False
    ) -> bool:
        """Consume a worker's result records; False if it exited."""
        try:
            data = os.read(worker.results_r, 1 << 16)
        except OSError:
            data = b""
        if not data:
            self._worker_gone(worker, selector, respawn=not start)
            return False
        buf = worker.buf
        buf += data
        done = []
        while len(buf) >= RESULT.size:
            slot, kind, extra, err, text_len = RESULT.unpack_from(buf)
            end = RESULT.size + text_len
            if len(buf) < end:
                break
            text = bytes(buf[RESULT.size : end]).decode("utf-8", "surrogateescape")
            del buf[:end]
            if kind == RESULT_HELLO:
                worker.ready = True
                continue
            done.append((slot - worker.index * _DEPTH, _decode(kind, extra, err, text)))
        if done:
            with self._cond:
                for slot, outcome in done:
                    held = worker.held[slot]
                    worker.held[slot] = None
                    self._held_blocks -= 1
                    if held is not None:
                        self._block_done(held[0], held[1], outcome)
        return True

    def _block_done(self, job: IoJob, index: int, outcome: BlockResult) -> None:
        """A block a worker held came back (pool lock held)."""
        if isinstance(outcome, Failed) and isinstance(outcome.error, OSError):
            self._note_error(outcome.error)
        with job._lock:
            job.running -= 1
            if job.expired or job.reported:
                self._stuck -= 1
            if job.reported:
                return
            self._record(job, index, outcome)

    def _finish_block(self, job: IoJob, index: int, outcome: BlockResult) -> None:
        """A block that never reached a worker (pool lock held)."""
        with job._lock:
            self._record(job, index, outcome)

    def _record(self, job: IoJob, index: int, outcome: BlockResult) -> None:
        """Store a block's result (job lock and pool lock held)."""
        job.outcomes[index] = outcome
        job.last_end = time.monotonic()
        job._left -= 1
        if job.is_load and isinstance(outcome, Failed) and job.next_block < len(job.keys):
            # Stop the load at its first failure: later blocks stay unread.
            rest = range(job.next_block, len(job.keys))
            self._loads.remove(job)
            self._blocks_out[True] += len(rest)
            job.next_block = len(job.keys)
            for later in rest:
                job.outcomes[later] = NOT_LOADED
            job._left -= len(rest)
        if job._claim_report():
            self._publish(job)

    def _publish(self, job: IoJob) -> None:
        self._finished.append(job)
        self._jobs_out += 1
        if self._jobs_out == self._jobs_in:
            self._cond.notify_all()

    def _worker_gone(
        self, worker: _Worker, selector: selectors.BaseSelector, respawn: bool
    ) -> None:
        """Fail what the worker held, reap it, start a replacement."""
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
            self.workers_died += 1
            logger.warning(
                "llmkv_fs: I/O worker %d (pid %s) ended with status %s holding %d block(s)%s",
                worker.index,
                proc.pid if proc else "?",
                status,
                len(lost),
                "; starting a replacement" if respawn and not self._stopping else "",
            )
        with self._cond:
            for slot, (job, index) in lost:
                worker.held[slot] = None
                self._held_blocks -= 1
                error = WorkerDied(f"I/O worker pid {proc.pid if proc else '?'} exited ({status})")
                self._block_done(job, index, Failed(Failure.ERROR, error))
            stopping = self._stopping
        if respawn and not stopping:
            self._respawn(worker, selector)

    def _respawn(self, worker: _Worker, selector: selectors.BaseSelector) -> None:
        for _attempt in range(_RESPAWN_LIMIT):
            try:
                self._spawn(worker, selector)
                return
            except OSError as exc:
                logger.warning("llmkv_fs: could not start an I/O worker: %r", exc)
        logger.error("llmkv_fs: I/O worker %d could not be replaced", worker.index)

    def _stop_workers(self, selector: selectors.BaseSelector) -> None:
        for worker in self._workers:
            if worker.jobs_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(worker.jobs_w, JOB.pack(OP_STOP, 0, 0, 0))
                with contextlib.suppress(OSError):
                    os.close(worker.jobs_w)
                worker.jobs_w = -1
        deadline = time.monotonic() + _STOP_GRACE_S
        for worker in self._workers:
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
