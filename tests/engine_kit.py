"""Shared helpers and fixtures for the engine tests (no vLLM, no torch).

Waiting is polling with a deadline; threads are held with Events/Barriers
that carry timeouts, never with sleeps.
"""

from __future__ import annotations

import hashlib
import mmap
import threading
import time

import pytest

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FinishedJob, FsEngine, prepare_volume
from llmkv_fs.engine.block.blockio import BlockIO, IoOptions
from llmkv_fs.layout.paths import CacheLayout, RunIdentity

BS = 64 * 1024
DEADLINE_S = 20.0
GATE_TIMEOUT_S = 15.0
IDENTITY = RunIdentity(
    model_name="m/x",
    dtype="bfloat16",
    tokens_per_hash=16,
    blocks_per_file=1,
    kv_cache_groups=((16, ("l0",)),),
)


def make_key(i, group: int = 0, *, hash_len: int = 32) -> bytes:
    """An OffloadKey: a block hash of ``hash_len`` bytes and the KV group index."""
    return hashlib.sha256(f"block-{i}".encode()).digest()[:hash_len] + group.to_bytes(4, "big")


def pattern(i, size: int = BS) -> bytes:
    unit = hashlib.sha256(f"payload-{i}".encode()).digest()
    return (unit * (size // len(unit) + 1))[:size]


def fill(primary, chunk: int, data: bytes, block_size: int = BS) -> None:
    primary[chunk * block_size : (chunk + 1) * block_size] = data


def row(primary, chunk: int, block_size: int = BS) -> bytes:
    return primary[chunk * block_size : (chunk + 1) * block_size]


def wait_jobs(engine: FsEngine, job_ids, deadline_s: float = DEADLINE_S) -> dict[int, FinishedJob]:
    """Poll take_finished until every id in job_ids came back (each once)."""
    wanted = set(job_ids)
    got: dict[int, FinishedJob] = {}
    deadline = time.monotonic() + deadline_s
    while not wanted <= got.keys():
        for job in engine.take_finished():
            assert job.job_id not in got, f"job {job.job_id} reported twice"
            got[job.job_id] = job
        if wanted <= got.keys():
            break
        if time.monotonic() > deadline:
            pytest.fail(f"jobs {sorted(wanted - got.keys())} not finished after {deadline_s}s")
        time.sleep(0.002)
    return got


def wait_until(predicate, what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


def settle(engine: FsEngine, key: bytes, request: str) -> bool:
    """Repeat lookup with end_step in between until it has a verdict."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        verdict = engine.lookup(key, request)
        if verdict is not None:
            return verdict
        if time.monotonic() > deadline:
            pytest.fail(f"no lookup verdict for {key.hex()[:12]} after {DEADLINE_S}s")
        engine.end_step()
        time.sleep(0.002)


class Gate:
    """Wraps engine.blockio.load/store: records (thread name, kind, key) on
    entry and, while closed, holds the calling I/O thread."""

    def __init__(self, engine: FsEngine, monkeypatch):
        self.opened = threading.Event()
        self.entries: list[tuple[str, str, bytes]] = []
        self._cond = threading.Condition()
        self.extra_wait = {}  # key -> Event the block waits for after the gate
        self.load_entered = threading.Event()
        real_load, real_store = engine.blockio.load, engine.blockio.store

        def wrap(kind, real):
            def wrapper(key, row_view, *rest):
                with self._cond:
                    self.entries.append((threading.current_thread().name, kind, key))
                    self._cond.notify_all()
                if kind == "load":
                    self.load_entered.set()
                self.opened.wait(GATE_TIMEOUT_S)
                extra = self.extra_wait.get(key)
                if extra is not None:
                    extra.wait(GATE_TIMEOUT_S)
                return real(key, row_view, *rest)

            return wrapper

        monkeypatch.setattr(engine.blockio, "load", wrap("load", real_load))
        monkeypatch.setattr(engine.blockio, "store", wrap("store", real_store))

    def wait_entered(self, n: int) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.entries) >= n, DEADLINE_S)
        assert ok, f"only {len(self.entries)} of {n} blocks reached the I/O threads"

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def engines():
    """make(root, n_blocks=16, block_size=BS, **settings) -> (engine, layout,
    primary); every engine is shut down (gates opened first) at teardown."""
    made: list[FsEngine] = []
    gates: list[Gate] = []

    def make(root, n_blocks: int = 16, block_size: int = BS, **settings):
        layout = CacheLayout.for_identity(root, IDENTITY)
        primary = mmap.mmap(-1, n_blocks * block_size)
        settings.setdefault("n_read_threads", 2)
        settings.setdefault("n_write_threads", 2)
        settings.setdefault("lookup_threads", 2)
        engine = FsEngine(TierSettings(root_dir=root, **settings), layout, primary, block_size)
        made.append(engine)
        return engine, layout, primary

    make.gates = gates
    yield make
    for gate in gates:
        gate.open()
    for engine in reversed(made):
        engine.shutdown()


@pytest.fixture
def gate_for(engines, monkeypatch):
    def install(engine):
        gate = Gate(engine, monkeypatch)
        engines.gates.append(gate)
        return gate

    return install


def store_blocks(engine, primary, job_id: int, ids, chunks) -> FinishedJob:
    for i, chunk in zip(ids, chunks):
        fill(primary, chunk, pattern(i))
    assert engine.submit_store(job_id, [make_key(i) for i in ids], list(chunks))
    job = wait_jobs(engine, [job_id])[job_id]
    assert job.success, job
    return job


def write_blocks(root: str, ids, rank: int = 0) -> tuple[CacheLayout, BlockIO]:
    """Store blocks ``pattern(i)`` under ``make_key(i)`` the way the tier does
    (temp file, trailer, rename), without an engine: for tools that read a volume."""
    layout = CacheLayout(root, CacheLayout.for_identity(root, IDENTITY).run_config, rank)
    prepare_volume(layout)
    blockio = BlockIO(
        layout,
        IoOptions(
            block_size=BS, use_o_direct=False, fsync_file=False, fsync_dir=False, checksum=True
        ),
    )
    buf = mmap.mmap(-1, BS)
    for i in ids:
        buf[:] = pattern(i)
        blockio.store(make_key(i), memoryview(buf))
    return layout, blockio
