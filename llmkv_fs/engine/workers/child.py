"""One I/O worker process: runs blocks for the engine's worker executor outside the
engine-core interpreter (no shared GIL with vLLM's scheduler).

Started by the worker executor's conductor (workers.Crew.spawn) as a fresh
interpreter (never a fork of vLLM)::

    python -c "<set umask 0>; from llmkv_fs.engine.workers.child import main; main()" LAUNCH

(``LAUNCH``: its ``crew.WorkerLaunch``, pickled, base64.)

It imports the engine room and what it stands on (volume, layout), never
vLLM or torch. Its life:

* ``PR_SET_PDEATHSIG`` (SIGKILL) ends it with the thread that spawned it
  (the worker executor's conductor, which lives as long as the executor),
  and EOF on its job pipe ends it too -- no worker outlives its engine;
* it maps the primary region from the fds it inherited (region.map_region)
  and pins itself to the CPUs the owner chose (NUMA);
* sealed blocks: its keys come through an inherited pipe it reads once
  (crew.keys_pipe), never on its command line or in its environment;
* umask 0 before anything is imported, so files and directories are created
  with exactly file_mode/dir_mode and need no chmod (one syscall per new
  fan-out directory fewer than in-process threads, which must not touch
  vLLM's umask);
* then it serves job records (records.JOB: a slice of one job's blocks)
  one at a time, runs each slice through a BlockStep built from the same
  spec as the engine's I/O threads' (block/spec.py: every per-block check,
  the block's contents plain or sealed, the shared volume signals, the
  pause points its launch carries)
  and answers with a result record (records.RESULT) on its result pipe. The
  slice's cancel byte in the shared cancel board is what the step reads as
  its job's ``cancelled`` byte: the owner sets it when the job's deadline
  passed, so an abandoned store is never published;
* the region's page tables are filled ahead of the I/O (prefault.py): a
  row before its first block here, the rest while the job pipe is idle;
* access stamps for LRU eviction are applied here, when the job pipe is idle
  or at most once a second -- the same BlockIO method the housekeeping
  thread runs in thread mode.

Threading: single-threaded.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import select
import signal
import sys
import time

from llmkv_fs.engine.block.blockio import BlockIO, BlockStep
from llmkv_fs.engine.block.spec import build_step
from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.engine.workers.crew import WorkerLaunch
from llmkv_fs.engine.workers.prefault import RowPrefault
from llmkv_fs.engine.workers.records import (
    OP_LOAD,
    OP_STOP,
    encode_result,
    hello_record,
    take_jobs,
)
from llmkv_fs.engine.workers.region import map_region
from llmkv_fs.layout.sealed import Keyring

_PR_SET_PDEATHSIG = 1
_STAMP_EVERY_S = 1.0


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _take_keys(fd: int) -> Keyring | None:
    """The sealing keys from their pipe (crew.keys_pipe), read to EOF and
    closed; None when the worker has no key pipe (blocks not sealed)."""
    if fd < 0:
        return None
    try:
        data = b""
        while chunk := os.read(fd, 4096):
            data += chunk
    finally:
        os.close(fd)
    return Keyring.from_bytes(data)


def _block_step(launch: WorkerLaunch) -> tuple[BlockStep, RowPrefault]:
    """The worker's BlockStep: the region and each root's signals page
    mapped from the inherited fds (closed once mapped), its own BlockIO per
    root, from the engine's step spec; and the region's page-table filler."""
    rows = map_region(launch.region_size, launch.segments, launch.region_fds)
    for fd in launch.region_fds:
        os.close(fd)
    spec = launch.step.with_keys(_take_keys(launch.keys_fd))
    blockios = [spec.blockio(index) for index in range(len(spec.roots))]
    signals = [VolumeSignals.attach(fd) for fd in launch.signals_fds]
    step = build_step(spec, rows, blockios, signals, launch.pause)
    return step, RowPrefault(rows, step.block_size)


class _AccessStamps:
    """The access stamps every root's BlockIO queued, applied together."""

    def __init__(self, blockios: list[BlockIO]):
        self._blockios = blockios

    def queued(self) -> bool:
        return any(blockio.has_queued_stamps() for blockio in self._blockios)

    def apply(self) -> None:
        for blockio in self._blockios:
            blockio.apply_access_stamps()


def serve(launch: WorkerLaunch) -> None:
    _die_with_parent(launch.parent)
    if launch.cpus:
        os.sched_setaffinity(0, launch.cpus)
    # A worker is one thread (the prefault runs between jobs on it), so this is
    # the whole worker. A positive increment is always permitted.
    os.nice(launch.nice)
    jobs_fd, results_fd = launch.jobs_fd, launch.results_fd
    step, prefault = _block_step(launch)
    stamps = _AccessStamps([root.blockio for root in step.roots])
    board = mmap.mmap(launch.board_fd, launch.board_size)
    os.close(launch.board_fd)
    # One byte of the board per slot, as the step reads a job's cancel byte
    # (the views pin the mapping for the worker's life, which it lasts anyway).
    cancel_bytes = [memoryview(board)[slot : slot + 1] for slot in range(launch.board_size)]
    os.write(results_fd, hello_record(os.getpid()))
    buf = bytearray()
    slices: collections.deque[tuple[int, int, list[int], list[bytes]]] = collections.deque()
    last_stamp = time.monotonic()
    # poll, not select: the pipe keeps the owner's fd number (pass_fds), and
    # vLLM raises RLIMIT_NOFILE, so it may be past select's limit of 1024.
    jobs_waiting = select.poll()
    jobs_waiting.register(jobs_fd, select.POLLIN)
    while True:
        if not slices:
            idle: bool | None = None
            if stamps.queued():
                now = time.monotonic()
                idle = not jobs_waiting.poll(0)
                if idle or now - last_stamp >= _STAMP_EVERY_S:
                    stamps.apply()
                    last_stamp = now
            if prefault.idle_work:
                if idle is None:
                    idle = not jobs_waiting.poll(0)
                if idle:
                    prefault.while_idle()
                    continue  # a few rows at a time: look for a job in between
            data = os.read(jobs_fd, 1 << 16)
            if not data:
                break  # the owner is gone or closed the pipe
            buf += data
            slices.extend(take_jobs(buf))
            continue
        op, slot, chunks, keys = slices.popleft()
        if op == OP_STOP:
            break
        for chunk in chunks:
            prefault.before_block(chunk)
        # The slot's cancel byte: set when its job passed the deadline (the
        # conductor keeps it), read before each block and before a rename.
        results = step.run_slice(op == OP_LOAD, keys, chunks, cancel_bytes[slot])
        _write_all(results_fd, b"".join(encode_result(slot, result) for result in results))
    stamps.apply()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main() -> None:
    launch = WorkerLaunch.decoded(sys.argv[1])
    try:
        serve(launch)
    except KeyboardInterrupt:
        pass
