"""What tools/bench/engine.py's configurations share: the primary buffer,
the scheduler stand-in, the keys and the driving loop (the machine's
description is llmkv_fs.harness.machine). Stdlib only (and llmkv_fs's layout)."""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time
from typing import Any, Protocol

from llmkv_fs.layout.names import offload_key
from llmkv_fs.layout.paths import RunIdentity

MiB = 1 << 20
IDENTITY = RunIdentity(
    model_name="bench/engine",
    dtype="bfloat16",
    tokens_per_hash=16,
    blocks_per_file=1,
    kv_cache_groups=((16, ("layer.0", "layer.1")),),
)


def make_keys(n: int, seed: str) -> list[bytes]:
    return [offload_key(hashlib.sha256(f"{seed}-{i}".encode()).digest()) for i in range(n)]


class Primary:
    """The CPU tier stand-in: nblocks rows of block bytes, page aligned, in
    shared memory a worker process can map (a memfd, or a /dev/shm file).
    Row i is its index (8 bytes, little-endian) then a fixed random tail,
    so a row in the wrong place or a torn one is seen by ``verify``."""

    def __init__(self, nblocks: int, block: int, shm: bool):
        self.size, self.block, self.path = nblocks * block, block, None
        if shm:
            self.path = f"/dev/shm/llmkv_bench_engine_{os.getpid()}.mmap"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        else:
            fd = os.memfd_create("llmkv_bench_primary", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.size)
            self.mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self._tail = os.urandom(block)[8:]
        for i in range(nblocks):
            self.mm[i * block : (i + 1) * block] = self.row(i)

    def row(self, i: int) -> bytes:
        return i.to_bytes(8, "little") + self._tail

    def zero(self, nblocks: int) -> None:
        empty = bytes(self.block)
        for i in range(nblocks):
            self.mm[i * self.block : (i + 1) * self.block] = empty

    def verify(self, nblocks: int) -> None:
        """Every byte of the first ``nblocks`` rows is what was stored."""
        b = self.block
        for i in range(nblocks):
            if self.mm[i * b : i * b + 8] != i.to_bytes(8, "little") or (
                self.mm[i * b + 8 : (i + 1) * b] != self._tail
            ):
                raise RuntimeError(f"loaded bytes of row {i} differ from stored bytes")

    def close(self) -> None:
        self.mm.close()
        if self.path:
            os.unlink(self.path)


class StandIn:
    """vLLM's engine-core thread, roughly: 0.5 ms of pure-Python work, a 1 ms
    pause, forever. ``rate()`` is iterations per second since ``mark()``."""

    BUSY_S, PAUSE_S = 0.0005, 0.001

    def __init__(self) -> None:
        self.iterations = 0
        self._stop = threading.Event()
        self._mark = (time.perf_counter(), 0)
        self._thread = threading.Thread(target=self._run, daemon=True, name="standin")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            end = time.perf_counter() + self.BUSY_S
            x = 0
            while time.perf_counter() < end:
                for i in range(50):
                    x += i * i
            self.iterations += 1
            time.sleep(self.PAUSE_S)

    def mark(self) -> None:
        self._mark = (time.perf_counter(), self.iterations)

    def rate(self) -> float:
        t0, n0 = self._mark
        return (self.iterations - n0) / max(1e-9, time.perf_counter() - t0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def standin_idle_rate(seconds: float = 2.0) -> float:
    standin = StandIn()
    time.sleep(0.2)
    standin.mark()
    time.sleep(seconds)
    rate = standin.rate()
    standin.stop()
    return rate


def worker_page_tables_kib(engine: Any) -> int:
    """Largest VmPTE among the engine's worker processes (0 for threads)."""
    most = 0
    for pid in getattr(getattr(engine, "executor", None), "worker_pids", lambda: [])():
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmPTE:"):
                        most = max(most, int(line.split()[1]))
        except OSError:
            pass
    return most


class Tier(Protocol):
    """What ``drive`` needs: FsEngine, or tools.bench.builtin.BuiltinTier."""

    def submit_store(self, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> bool: ...

    def submit_load(self, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> bool: ...

    def take_finished(self) -> list[Any]: ...


def drive(
    engine: Tier, keys: list[bytes], per_job: int, load: bool, poll_s: float, first_id: int
) -> tuple[float, float]:
    """Submit every block as jobs of ``per_job``; poll until all finish.
    Returns (seconds, owner seconds spent inside submit_* and take_finished)."""
    pending = set()
    clock = time.perf_counter
    started = clock()
    owner = 0.0
    for job_id, lo in enumerate(range(0, len(keys), per_job), start=first_id):
        chunk_ids = list(range(lo, min(lo + per_job, len(keys))))
        t = clock()
        if load:
            ok = engine.submit_load(job_id, keys[lo : lo + per_job], chunk_ids)
        else:
            ok = engine.submit_store(job_id, keys[lo : lo + per_job], chunk_ids)
        owner += clock() - t
        if not ok:
            raise RuntimeError("job refused: raise --blocks or max_pending_store_bytes")
        pending.add(job_id)
    while pending:
        t = clock()
        finished = engine.take_finished()
        owner += clock() - t
        for job in finished:
            if job.failed:
                raise RuntimeError(
                    f"{'load' if load else 'store'} job {job.job_id}: "
                    f"{len(job.failed)} blocks failed ({dict(getattr(engine, 'counters', {}))})"
                )
            pending.discard(job.job_id)
        if pending:
            time.sleep(poll_s)
    return clock() - started, owner
