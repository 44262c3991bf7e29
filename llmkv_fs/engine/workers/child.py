"""One I/O worker process: runs blocks for the engine's ProcPool outside the
engine-core interpreter (no shared GIL with vLLM's scheduler).

Started by the ProcPool's conductor (workers.Crew.spawn) as a fresh
interpreter (never a fork of vLLM)::

    python -c "<set umask 0>; from llmkv_fs.engine.workers.child import main; main()" SPEC_JSON

It imports only the engine room and the layout. Its life:

* ``PR_SET_PDEATHSIG`` (SIGKILL) ends it with the owner thread that spawned
  it (the pool's conductor, which lives as long as the pool), and EOF on its
  job pipe ends it too -- no worker outlives its engine;
* it maps the primary region from the fds it inherited (region.map_region)
  and pins itself to the CPUs the owner chose (NUMA);
* umask 0 before anything is imported, so files and directories are created
  with exactly file_mode/dir_mode and need no chmod (one syscall per new
  fan-out directory fewer than in-process threads, which must not touch
  vLLM's umask);
* then it serves job records (records.JOB) one at a time and answers each
  with a result record (records.RESULT) on its result pipe. Before running a
  block and again right before a store's rename it reads the block's cancel
  byte in the shared cancel board: the owner sets it when the job's deadline
  passed, so an abandoned store is never published;
* access stamps for LRU eviction are applied here, when the job pipe is idle
  or at most once a second -- the same BlockIO method the housekeeping
  thread runs in thread mode.

Threading: single-threaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import select
import signal
import sys
import time
from typing import Any

from llmkv_fs.engine.block.blockio import BlockIO, IoOptions
from llmkv_fs.engine.outcomes import Outcome
from llmkv_fs.engine.workers.records import (
    JOB,
    OP_LOAD,
    OP_STOP,
    OUTCOME_CODES,
    RESULT,
    RESULT_CANCELLED,
    RESULT_HELLO,
    encode_error,
)
from llmkv_fs.engine.workers.region import map_region
from llmkv_fs.layout.files import PinnedRoot
from llmkv_fs.layout.paths import CacheLayout

_PR_SET_PDEATHSIG = 1
_STAMP_EVERY_S = 1.0


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def serve(spec: dict[str, Any]) -> None:
    _die_with_parent(spec["parent"])
    if spec["cpus"]:
        os.sched_setaffinity(0, spec["cpus"])
    jobs_fd, results_fd = spec["jobs_fd"], spec["results_fd"]
    row_view = map_region(spec["size"], spec["segments"], spec["region_fds"])
    for fd in spec["region_fds"]:
        os.close(fd)
    board = mmap.mmap(spec["board_fd"], spec["board_size"])
    os.close(spec["board_fd"])
    layout = CacheLayout(spec["root_dir"], spec["run_config"], spec["rank"])
    root = spec.get("root")
    pinned = None if root is None else PinnedRoot(root[0], (root[1], root[2]))
    blockio = BlockIO(layout, IoOptions(**spec["options"], root=pinned))
    block_size = blockio.options.block_size
    os.write(results_fd, RESULT.pack(0, RESULT_HELLO, 0, os.getpid(), 0))
    buf = bytearray()
    last_stamp = time.monotonic()
    while True:
        if len(buf) < JOB.size:
            if blockio.has_queued_stamps():
                now = time.monotonic()
                idle = not select.select([jobs_fd], [], [], 0)[0]
                if idle or now - last_stamp >= _STAMP_EVERY_S:
                    blockio.apply_access_stamps()
                    last_stamp = now
            data = os.read(jobs_fd, 1 << 16)
            if not data:
                break  # the owner is gone or closed the pipe
            buf += data
            continue
        op, slot, chunk, key_len = JOB.unpack_from(buf)
        end = JOB.size + key_len
        if len(buf) < end:
            data = os.read(jobs_fd, 1 << 16)
            if not data:
                break
            buf += data
            continue
        key = bytes(buf[JOB.size : end])
        del buf[:end]
        if op == OP_STOP:
            break
        os.write(results_fd, _run(blockio, board, op, slot, key, row_view, chunk, block_size))
    blockio.apply_access_stamps()


def _run(
    blockio: BlockIO,
    board: mmap.mmap,
    op: int,
    slot: int,
    key: bytes,
    primary: memoryview,
    chunk: int,
    block_size: int,
) -> bytes:
    if board[slot]:  # the job passed its deadline while this block waited
        return RESULT.pack(slot, RESULT_CANCELLED, 0, 0, 0)
    if (chunk + 1) * block_size > primary.nbytes:
        # A memoryview slice would clamp silently and copy the wrong bytes.
        error = IndexError(f"chunk {chunk} outside the primary buffer")
        return encode_error(slot, error)
    row = primary[chunk * block_size : (chunk + 1) * block_size]
    try:
        if op == OP_LOAD:
            outcome: Outcome = blockio.load(key, row)
        else:
            outcome = blockio.store(key, row, lambda: not board[slot])
    except Exception as exc:  # reported per block; never ends the worker
        return encode_error(slot, exc)
    finally:
        with contextlib.suppress(BufferError):  # a view still exported: freed with it
            row.release()
    return RESULT.pack(slot, OUTCOME_CODES.index(outcome), 0, 0, 0)


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        serve(spec)
    except KeyboardInterrupt:
        pass
