"""The I/O pool in worker processes: the same interface as pool.IoPool, but
each block runs in a worker process (worker.py) that maps the primary region
itself, so the per-block Python no longer shares vLLM's GIL.

Roles
-----
* The owner (vLLM's scheduler side) calls ``submit``, ``take_finished``,
  ``has_news``, ``expire_overdue``: they append to or pop from deques under
  a short lock, and ``submit`` writes 8 bytes to an eventfd. They never wait
  on a worker.
* One conductor thread (conductor.py) moves records: it gives each ready
  worker up to ``DEPTH`` blocks (one running, one waiting in its pipe, so a
  worker never idles between blocks), reads result records, fills
  ``job.outcomes`` and queues finished jobs. It spawns every worker, so PR_SET_PDEATHSIG (which
  fires when the spawning *thread* exits) ties workers to the pool's life.
* Workers: see worker.py; their handles and life (spawn, reap, replace,
  stop) and the shared cancel board: workers.py; the records the conductor
  and the workers exchange: records.py.

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
import os
import threading
from collections.abc import Callable

from llmkv_fs.engine.workers.conductor import Conductor
from llmkv_fs.engine.outcomes import DEADLINE
from llmkv_fs.engine.threads.pool import IoJob, QueueFull
from llmkv_fs.engine.workers.crew import (
    DEPTH,
    START_TIMEOUT_S,
    Crew,
    WorkerDied,
    WorkerSpec,
    resolve_io_workers,
)

__all__ = ["ProcPool", "WorkerDied", "WorkerSpec", "resolve_io_workers"]

# The owner wakes the conductor with a write that keeps the GIL (a PyDLL call
# does not release it; os.eventfd_write does): releasing it would hand the
# GIL to the conductor it just woke and make the owner wait for it back --
# measured on 2 cores, up to ~190 us per submitted block.
_write_holding_gil = ctypes.PyDLL(None).write
_write_holding_gil.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_write_holding_gil.restype = ctypes.c_ssize_t
_ONE = ctypes.byref(ctypes.c_uint64(1))


class ProcPool(Conductor):
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
        self._crew = Crew(spec, n_workers, name)
        self._board = self._crew.board.places
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._workers = self._crew.workers
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._conductor = threading.Thread(
            target=self._conduct, name=f"{name}_conductor", daemon=True
        )
        self._conductor.start()
        if not self._started.wait(START_TIMEOUT_S) or self._start_error is not None:
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

    def queued_store_blocks(self) -> int:
        return self._blocks_in[False] - self._blocks_out[False]

    def queued_load_blocks(self) -> int:
        return self._blocks_in[True] - self._blocks_out[True]

    def busy_threads(self) -> int:
        return self._held_blocks

    def busy(self) -> bool:
        return self._jobs_in > self._jobs_out or bool(self._finished)

    def worker_pids(self) -> list[int]:
        return self._crew.pids()

    @property
    def workers_started(self) -> int:
        return self._crew.started

    @property
    def workers_died(self) -> int:
        return self._crew.died

    def max_in_flight(self) -> int:
        """Blocks the workers can hold at once (running or in their pipes)."""
        return len(self._workers) * DEPTH

    def _expire(self, job: IoJob) -> int:
        with self._cond:
            queued = self._unqueue(job)
            for worker in self._workers:
                for slot, held in enumerate(worker.held):
                    if held is not None and held[0] is job:
                        self._board[worker.index * DEPTH + slot] = 1
            with job._lock:
                job.expired = True
                in_flight = job.running
                self._stuck += in_flight
                report = job._fail(queued, DEADLINE, all_unfinished=not job.is_load)
            if report:
                self._publish(job)
        return len(queued) + (0 if job.is_load else in_flight)

    def drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._jobs_in == self._jobs_out)

    def shutdown(self) -> None:
        self._cancel_queued()
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake, 1)
        if self._conductor.ident != threading.get_ident():
            self._conductor.join()
        with contextlib.suppress(OSError):
            os.close(self._wake)
        self._crew.board.close()
