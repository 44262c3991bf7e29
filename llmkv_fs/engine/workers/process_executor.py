"""The worker-process executor: blocks run in I/O worker processes
(workers/child.py) that map the primary region themselves, so the per-block
Python does not share vLLM's GIL. What a block passes through in a worker
is the same BlockStep an I/O thread runs (block/blockio.py).

Roles
-----
* The scheduler (owner thread) calls ``work_arrived`` -- 8 bytes to an
  eventfd when the conductor sleeps -- and ``job_expired``, which sets the
  cancel byte of every place holding a block of that job. Neither waits.
* One conductor thread moves records: it gives each ready worker up to
  ``DEPTH`` slices taken from the scheduler (one running, one waiting in its
  pipe, so a worker never idles between them; a slice is one or more blocks
  of one job, one record), reads result records and gives each slice back
  to the scheduler once every block of it has answered. It spawns every worker, so
  PR_SET_PDEATHSIG (which fires when the spawning *thread* exits) ties the
  workers to the executor's life; their life (spawn, reap, replace with a
  growing pause, stop) is workers/crew.py.

Guarantees:
* A block past its job's deadline sees the cancel byte before starting and
  again before a store's rename: an abandoned store is never published.
* A worker that dies (crash, SIGKILL, OOM) fails exactly the blocks it held
  (Failure.WORKER_DIED), is replaced, and the executor keeps serving.
* No byte a dead worker put into a row reaches vLLM: the rows of every load
  block it held and had not answered (the block it was reading, earlier
  blocks of its slice whose results it had not sent yet, and the slice
  waiting in its pipe) are zeroed before those blocks are given back. The
  conductor zeroes them, after the worker is reaped (no process writes them
  any more) and before ``slice_done``: a load job is reported to vLLM only
  once all its blocks are back (scheduling/scheduler.py), so until then no
  other job names those rows and no replacement worker can be given them --
  a replacement gets slices only from this same thread, afterwards.
* ``stop`` waits for held blocks at most ``crew.STOP_GRACE_S``, then kills
  the workers (a stopped or stuck worker cannot hang shutdown) and gives
  their blocks back CANCELLED; every fd is closed, no process is left.
* The conductor never dies of an exception: after one it stops the workers
  and fails every block it is given until stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import selectors
import threading
import time
from collections.abc import Sequence

from llmkv_fs.engine.outcomes import BlockResult, Failed, Failure
from llmkv_fs.engine.scheduling.scheduler import BlockSlice, BlockSource, IoJob
from llmkv_fs.engine.workers import crew as crew_module
from llmkv_fs.engine.workers.crew import DEPTH, START_TIMEOUT_S, Crew, WorkerHandle, WorkerSpec
from llmkv_fs.engine.workers.records import HELLO, OP_LOAD, OP_STORE, job_record, take_results

__all__ = ["ProcessExecutor"]

logger = logging.getLogger("vllm.llmkv_fs.workers")

# The owner wakes the conductor with a write that keeps the GIL (a PyDLL call
# does not release it; os.eventfd_write does): releasing it would hand the
# GIL to the conductor it just woke and make the owner wait for it back, per
# submitted block (docs/benchmarks.md, "Figures behind the code").
_write_holding_gil = ctypes.PyDLL(None).write
_write_holding_gil.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_write_holding_gil.restype = ctypes.c_ssize_t
_ONE = ctypes.byref(ctypes.c_uint64(1))


class ProcessExecutor:
    """Implements scheduling.scheduler.Executor with worker processes.
    ``start`` blocks until every worker mapped the region and said hello; it
    raises OSError/RuntimeError if they cannot (the engine then uses threads)."""

    def __init__(self, spec: WorkerSpec, n_workers: int, rows: memoryview, name: str = "llmkv_fs"):
        self._crew = Crew(spec, n_workers, name)
        # The engine's flat view of the primary region (the same pages the
        # workers map), written here only to zero a dead worker's rows.
        self._rows = rows
        self._block_size = spec.step.roots[0].options.block_size
        self._workers = self._crew.workers
        self._board = self._crew.board.places
        self._name = name
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._idle = False  # asleep in select: work_arrived must wake it
        self._stop_requested = False
        self._held_blocks = 0
        self._source: BlockSource | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._conductor = threading.Thread(
            target=self._conduct, name=f"{name}_conductor", daemon=True
        )

    # -- the scheduler's calls (owner thread) ------------------------------------

    def start(self, source: BlockSource) -> None:
        self._source = source
        self._conductor.start()
        if not self._started.wait(START_TIMEOUT_S) or self._start_error is not None:
            self.stop()
            raise RuntimeError(f"I/O workers did not start: {self._start_error!r}")

    def work_arrived(self, blocks: int) -> None:
        if self._idle:
            _write_holding_gil(self._wake, _ONE, 8)

    def job_expired(self, job: IoJob) -> None:
        for worker in self._workers:
            for slot, held in enumerate(worker.held):
                if held is not None and held.job is job:
                    self._board[worker.index * DEPTH + slot] = 1

    def stop(self) -> None:
        self._stop_requested = True
        with contextlib.suppress(OSError, ValueError):  # ValueError: stopped before
            os.eventfd_write(self._wake, 1)
        if self._conductor.ident is not None and self._conductor.ident != threading.get_ident():
            self._conductor.join()
        # Idempotent: a second shutdown must not close fd numbers that
        # belong to someone else by then (found: a later engine's workers
        # failed to spawn with EBADF).
        if self._wake >= 0:
            with contextlib.suppress(OSError):
                os.close(self._wake)
            self._wake = -1
        self._crew.board.close()

    def capacity(self) -> int:
        """Slices the workers hold at once: DEPTH each."""
        return len(self._workers) * DEPTH

    def worker_pids(self) -> list[int]:
        return self._crew.pids()

    def deaths(self) -> int:
        return self._crew.died

    # -- the conductor thread ----------------------------------------------------

    def _conduct(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake, selectors.EVENT_READ, None)
        try:
            self._crew.start_all(selector, self._read_results)
        except BaseException as exc:  # reported to start()
            self._start_error = exc
            self._crew.stop(selector, grace_s=0.0)
            selector.close()
            self._started.set()
            return
        self._started.set()
        clean = False
        try:
            clean = self._serve(selector)
        except BaseException:  # never dies silently
            logger.exception("llmkv_fs: the I/O conductor failed; stopping the worker processes")
            self._crew.stop(selector, grace_s=0.0)
            self._give_back_held(Failure.ERROR, "the I/O conductor failed")
            self._fail_until_stopped()
        finally:
            # Idle workers exit by themselves (applying their access stamps);
            # after the grace ran out on held blocks they are killed at once.
            self._crew.stop(selector, grace_s=crew_module.STOP_GRACE_S if clean else 0.0)
            self._give_back_held(Failure.CANCELLED, "stopped at shutdown")
            selector.close()

    def _serve(self, selector: selectors.BaseSelector) -> bool:
        """Run until stopped; False if held blocks outlived the stop grace."""
        give_up_at: float | None = None
        while True:
            if self._stop_requested:
                if self._held_blocks == 0:
                    return True
                if give_up_at is None:
                    give_up_at = time.monotonic() + crew_module.STOP_GRACE_S
                elif time.monotonic() >= give_up_at:
                    logger.warning(
                        "llmkv_fs: %d block(s) still held by I/O workers after %.0fs; killing them",
                        self._held_blocks,
                        crew_module.STOP_GRACE_S,
                    )
                    return False
            self._send(self._dispatch())
            self._idle = True
            # Taken after _idle is set: work submitted since the last take
            # either is seen here or its submit saw _idle and wakes us.
            writes = self._dispatch()
            if writes:
                self._idle = False
                self._send(writes)
                continue
            events = selector.select(self._timeout(give_up_at))
            self._idle = False
            for key, _ in events:
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wake)
                else:
                    self._read_results(key.data, selector)
            due = self._crew.next_respawn
            if due is not None and due <= time.monotonic():
                self._crew.respawn_due(selector)

    def _timeout(self, give_up_at: float | None) -> float | None:
        deadlines = [t for t in (give_up_at, self._crew.next_respawn) if t is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _dispatch(self) -> list[tuple[int, bytes]]:
        """Give ready workers blocks up to DEPTH each: every worker's first
        place before any second one, so a job spreads over all workers (its
        blocks run at once) instead of queueing two by two in one pipe."""
        writes: list[tuple[int, bytes]] = []
        source = self._source
        assert source is not None
        if self._stop_requested:
            return writes
        for slot in range(DEPTH):
            for worker in self._workers:
                if not worker.ready or worker.held[slot] is not None:
                    continue
                taken = source.take(worker.load_first)
                if taken is None:
                    return writes
                writes.append((worker.jobs_w, self._place(worker, slot, taken)))
        return writes

    def _place(self, worker: WorkerHandle, slot: int, taken: BlockSlice) -> bytes:
        board_slot = worker.index * DEPTH + slot
        self._board[board_slot] = 0
        worker.held[slot] = taken
        worker.got[slot] = []
        self._held_blocks += taken.n_blocks
        job = taken.job
        # After the place is visible to job_expired: an expiry between take()
        # and here is seen either by it or by this check.
        if job.expired:
            self._board[board_slot] = 1
        op = OP_LOAD if job.is_load else OP_STORE
        return job_record(op, board_slot, taken.chunks, taken.keys)

    @staticmethod
    def _send(writes: list[tuple[int, bytes]]) -> None:
        for fd, record in writes:
            with contextlib.suppress(OSError):  # a dead worker: its EOF fails them
                os.write(fd, record)

    def _read_results(self, worker: WorkerHandle, selector: selectors.BaseSelector) -> bool:
        """Consume a worker's result records; False if it exited."""
        try:
            data = os.read(worker.results_r, 1 << 16)
        except OSError:
            data = b""
        if not data:
            self._worker_gone(worker, selector)
            return False
        worker.buf += data
        for slot, kind, _pid, result in take_results(worker.buf):
            if kind == HELLO:
                self._crew.said_hello(worker)
                continue
            assert result is not None
            place = slot - worker.index * DEPTH
            taken, got = worker.held[place], worker.got[place]
            if taken is not None:
                got.append(result)
                if len(got) == taken.n_blocks:
                    self._give_back(worker, place, got)
        return True

    def _give_back(self, worker: WorkerHandle, slot: int, results: list[BlockResult]) -> None:
        taken = worker.held[slot]
        worker.held[slot], worker.got[slot] = None, []
        if taken is not None:
            self._held_blocks -= taken.n_blocks
            assert self._source is not None
            self._source.slice_done(taken, results)

    def _fail_held(self, worker: WorkerHandle, failure: Failed) -> None:
        """Give back what ``worker`` holds: the results it sent, ``failure``
        for the rest of each slice. The worker's process is gone (reaped or
        killed and waited for): the rows of the load blocks it had not
        answered are zeroed first (see the module doc)."""
        for slot, taken in enumerate(worker.held):
            if taken is not None:
                got = worker.got[slot]
                if taken.job.is_load:
                    self._zero_rows(taken.chunks[len(got) :])
                self._give_back(worker, slot, [*got, *[failure] * (taken.n_blocks - len(got))])

    def _zero_rows(self, chunks: Sequence[int]) -> None:
        """Zero the rows of ``chunks`` (one outside the primary buffer was
        never written: the worker's step refuses it)."""
        if not chunks:
            return
        size = self._block_size
        rows = self._rows.nbytes // size
        zeros = bytes(size)
        for chunk in chunks:
            if 0 <= chunk < rows:
                self._rows[chunk * size : (chunk + 1) * size] = zeros

    def _worker_gone(self, worker: WorkerHandle, selector: selectors.BaseSelector) -> None:
        """Fail what the worker held, reap it, schedule its replacement."""
        why = self._crew.reap(worker, selector, replace=not self._stop_requested)
        self._fail_held(worker, Failed(Failure.WORKER_DIED, crew_module.WorkerDied(why)))

    def _give_back_held(self, reason: Failure, why: str) -> None:
        for worker in self._workers:
            self._fail_held(worker, Failed(reason, crew_module.WorkerDied(why)))

    def _fail_until_stopped(self) -> None:
        """After a conductor failure: every block taken fails, until stop."""
        source = self._source
        assert source is not None
        # poll, not select: vLLM raises RLIMIT_NOFILE, so the eventfd may be
        # numbered past select's limit of 1024 (ValueError: found in review).
        wake = select.poll()
        wake.register(self._wake, select.POLLIN)
        while not self._stop_requested:
            taken = source.take(True)
            if taken is None:
                self._idle = True
                if source.take(True) is None:  # see _serve on taking after _idle
                    wake.poll()
                with contextlib.suppress(OSError):
                    os.eventfd_read(self._wake)
                self._idle = False
                continue
            failure = Failed(Failure.ERROR, RuntimeError("I/O conductor failed"))
            source.slice_done(taken, [failure] * taken.n_blocks)
