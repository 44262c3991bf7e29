"""Shared helpers and fixtures for the engine tests (no vLLM, no torch).

Waiting is polling with a deadline; threads are held with Events/Barriers
that carry timeouts, never with sleeps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FinishedJob, FsEngine, lookup, lookup_checks, prepare_volume
from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.block.pause import PausePoints
from llmkv_fs.engine.outcomes import Failure
from llmkv_fs.engine.scheduling import scheduler
from llmkv_fs.layout.paths import CacheLayout, RunIdentity
from tests.kits.clock_kit import ManualClock

BS = 256 * 1024  # a lone job then spreads one block per place (engine/launch.py)
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


def housekeeping_rounds(keeper, n: int) -> None:
    """Wait until a root's housekeeping thread has sampled the volume ``n``
    more times: each round samples it first, so with ``n >= 2`` the round
    before the last is whole (everything it does came after this call)."""
    for _ in range(n):
        seen = keeper.guard.usage
        keeper._wake.set()
        wait_until(lambda seen=seen: keeper.guard.usage is not seen, "a housekeeping round")


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


def replace_checks(monkeypatch, check) -> None:
    """Every existence check of the test's engines runs ``check(blockio,
    key)`` instead of looking at the volume: one key at a time
    (``BlockIO.exists``) and a chunk at once (``exists_many``, the compiled
    check's seam: ``check`` per key, in order, whatever the budget). Patched
    on the class, so engines started before and after alike."""
    monkeypatch.setattr(BlockIO, "exists", check)

    def many(self, keys: list[bytes], budget_s: float = 0.0) -> list[bool]:
        return [check(self, key) for key in keys]

    monkeypatch.setattr(BlockIO, "exists_many", many)


class Checks:
    """What ``AsyncExistence`` checks keys with, for a test that drives the
    lookups on their own (engine/lookup_checks.py, ``Presence``): ``exists``
    per key and, when given, ``exist_many`` a chunk at once."""

    def __init__(
        self,
        exists: Callable[[bytes], bool | None],
        exist_many: Callable[[list[bytes], float], list[bool | None]] | None = None,
    ):
        self.one = exists
        self.batched = exist_many is not None
        self._many = exist_many

    def many(self, keys: list[bytes], budget_s: float) -> list[bool | None]:
        assert self._many is not None
        return self._many(keys, budget_s)


class PauseMark(NamedTuple):
    """One block stopped at a pause point: its marker's fields."""

    when_ns: int
    pid: int
    thread: int
    op: str
    key: bytes


def pause_marks(pause_dir: str, point: str) -> list[PauseMark]:
    """The blocks that stopped at ``point`` so far, in arrival order (the
    markers engine/block/pause.py names)."""
    marks = []
    for name in os.listdir(pause_dir):
        if name.startswith(f"at.{point}."):
            _at, _point, op, key_hex, pid, thread, when = name.split(".")
            marks.append(PauseMark(int(when), int(pid), int(thread), op, bytes.fromhex(key_hex)))
    return sorted(marks)


class Gate:
    """Holds blocks at one of the engine's pause points (engine/block/pause.py)
    -- in its I/O threads and in its worker processes alike, through files in
    the pause directory the ``io_mode`` fixture gives every engine. Records
    (place, kind, key) per block that reached it, in arrival order; ``place``
    is ``<pid>.<thread id>``. ``kinds`` limits it to loads or stores;
    ``point`` is ``enter`` (before any check or I/O of the block: a held
    block re-checks its deadline when let go), ``read`` (a load past its
    checks: a read the volume has not answered) or ``publish`` (a store's
    temp file written and closed, right before its rename)."""

    def __init__(
        self,
        engine: FsEngine,
        pause_dir: str,
        kinds: tuple[str, ...] = (),
        point: str = "enter",
    ):
        assert engine._pause is not None, "the engine started without a pause directory"
        self.dir = pause_dir
        self.point = point
        self.opened = _FileFlag(os.path.join(pause_dir, "open"))
        for suffix in [f".{k}" for k in kinds] or [""]:
            _touch(os.path.join(pause_dir, f"armed.{point}{suffix}"))

    @property
    def entries(self) -> list[tuple[str, str, bytes]]:
        return [(f"{m.pid}.{m.thread}", m.op, m.key) for m in pause_marks(self.dir, self.point)]

    def wait_entered(self, n: int) -> None:
        wait_until(lambda: len(self.entries) >= n, f"{n} blocks at the gate")

    def hold(self, key: bytes) -> None:
        """Keep ``key``'s block at the gate after it opens, until release."""
        _touch(os.path.join(self.dir, f"hold.{key.hex()}"))

    def release(self, key: bytes) -> None:
        os.unlink(os.path.join(self.dir, f"hold.{key.hex()}"))

    def open(self) -> None:
        self.opened.set()

    def close_for_good(self) -> None:
        """Open it and disarm it (teardown: blocks no longer stop)."""
        for name in os.listdir(self.dir):
            if name.startswith(("armed.", "hold.")):
                os.unlink(os.path.join(self.dir, name))
        self.open()


class _FileFlag:
    def __init__(self, path: str):
        self.path = path

    def is_set(self) -> bool:
        return os.path.exists(self.path)

    def set(self) -> None:
        _touch(self.path)


def _touch(path: str) -> None:
    with open(path, "a"):
        pass


def memfd_primary(size: int) -> mmap.mmap:
    """A primary buffer worker processes can map (vLLM's is a /dev/shm file)."""
    fd = os.memfd_create("llmkv_test_primary", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    primary = mmap.mmap(fd, size)
    os.close(fd)  # like vLLM after start-up: only the mapping is left
    return primary


# Read by tests/kits/tier_kit.py (tiers started through vLLM's stack): the io_mode
# fixture's choice (unset means threads) and its pause directory (unset: no
# pause points). Test side only: the product reads neither.
IO_WORKERS_ENV = "LLMKV_FS_TEST_IO_WORKERS"
PAUSE_DIR_ENV = "LLMKV_FS_TEST_PAUSE_DIR"


# I/O worker processes per engine in the "workers" mode: one per I/O thread
# the test asks for, so both modes run as many blocks at once.
def _workers_for(settings: dict) -> int:
    return settings.get("n_read_threads", 2) + settings.get("n_write_threads", 2)


@pytest.fixture(params=[0, 2], ids=["threads", "workers"])
def io_mode(request, tmp_path_factory, monkeypatch):
    """The engine's executor for this test: I/O threads (``io_workers: 0``)
    or worker processes. Every engine the test starts -- through ``engines``
    or vLLM's stack (tests/kits/tier_kit.py) -- gets it, and a pause directory for
    ``Gate``. A module that drives the engine without ``engines`` opts in
    with ``pytestmark = pytest.mark.usefixtures("io_mode")``."""
    pause_dir = str(tmp_path_factory.mktemp("pause"))
    monkeypatch.setenv(PAUSE_DIR_ENV, pause_dir)
    monkeypatch.setenv(IO_WORKERS_ENV, str(request.param))
    return IoMode(bool(request.param), pause_dir)


@dataclasses.dataclass(frozen=True)
class IoMode:
    workers: bool
    pause_dir: str


@pytest.fixture
def engines(io_mode):
    """make(root, n_blocks=16, block_size=BS, **settings) -> (engine, layout,
    primary) in the test's ``io_mode``; every engine is shut down (gates
    opened first) at teardown."""
    made: list[FsEngine] = []
    gates: list[Gate] = []

    def make(root, n_blocks: int = 16, block_size: int = BS, **settings):
        """``root`` may list several roots (with path_sharding="by_block_hash");
        the layout returned is the first root's."""
        primary = memfd_primary(n_blocks * block_size)
        if io_mode.workers:
            settings.setdefault("io_workers", _workers_for(settings))
        settings.setdefault("n_read_threads", 2)
        settings.setdefault("n_write_threads", 2)
        settings.setdefault("lookup_threads", 2)
        tier_settings = TierSettings(root_dir=root, **settings)
        layouts = [CacheLayout.for_identity(r, IDENTITY) for r in tier_settings.root_dirs]
        layout = layouts[0]
        pause = PausePoints(io_mode.pause_dir)
        engine = FsEngine(tier_settings, layouts, primary, block_size, pause)
        made.append(engine)
        if io_mode.workers and settings.get("io_workers", 0):
            assert engine.io_workers == settings["io_workers"], "worker mode fell back to threads"
        return engine, layout, primary

    make.gates = gates
    make.mode = io_mode
    yield make
    for gate in gates:
        gate.close_for_good()
    for engine in reversed(made):
        engine.shutdown()


@pytest.fixture
def gate_for(engines):
    def install(engine, kinds: tuple[str, ...] = (), point: str = "enter"):
        gate = Gate(engine, engines.mode.pause_dir, kinds, point)
        engines.gates.append(gate)
        return gate

    return install


@pytest.fixture
def gate_on(io_mode):
    """gate_on(engine, kinds=(), point="enter") -> a Gate on any engine of
    the test, one vLLM's stack started too (tests/kits/tier_kit.py); every
    gate is opened for good at teardown, before the replicas close."""
    made: list[Gate] = []

    def install(engine, kinds: tuple[str, ...] = (), point: str = "enter") -> Gate:
        gate = Gate(engine, io_mode.pause_dir, kinds, point)
        made.append(gate)
        return gate

    yield install
    for gate in made:
        gate.close_for_good()


@pytest.fixture
def engine_clock(monkeypatch) -> ManualClock:
    """The clock of job deadlines, job latencies and lookup deadlines, for
    every engine of the test (they run in this process in both io modes: a
    worker process only sees a cancelled block)."""
    return ManualClock().install(monkeypatch, scheduler, lookup, lookup_checks)


class Inside:
    """What a test reads or drives inside an engine beyond what the tier
    calls -- the one place tests reach the engine's private parts, so the
    product's public names stay the tier's."""

    def __init__(self, engine: FsEngine):
        self._engine = engine

    @property
    def lookups(self) -> lookup.AsyncExistence:
        return self._engine._lookups

    @property
    def executor(self) -> Any:
        return self._engine._executor

    @property
    def placement(self) -> Any:
        return self._engine._placement

    @property
    def pause(self) -> PausePoints | None:
        return self._engine._pause

    @property
    def slice_blocks(self) -> int:
        return self._engine._slice_blocks

    @property
    def step_spec(self) -> Any:
        return self._engine._step_spec

    def recheck_stalled(self) -> bool:
        """The owner's recheck of the volume, run now: whether it is stalled."""
        self._engine._recheck()
        return bool(self._engine._stalled)

    def recheck_volume_failed(self) -> bool:
        """The owner's recheck of the volume, run now: whether every root is lost."""
        return self._engine._recheck() is Failure.ROOT_LOST

    def queued_store_blocks(self) -> int:
        return self._engine.gauges()["queued_store_blocks"]

    def tracked_keys(self) -> int:
        return tracked_keys(self.lookups)

    def remembered_misses(self) -> int:
        return remembered_misses(self.lookups)


def inside(engine: FsEngine) -> Inside:
    return Inside(engine)


def tracked_keys(lookups: lookup.AsyncExistence) -> int:
    """Keys the lookups keep a state for."""
    return len(lookups._states)


def remembered_misses(lookups: lookup.AsyncExistence) -> int:
    """Keys answered miss without a probe for a while (failed loads)."""
    return len(lookups._misses)


def workers_started(executor: Any) -> int:
    """Worker processes a ProcessExecutor has started, cumulative."""
    return int(executor._crew.started)


def held_by_executor(engine: FsEngine, n: int) -> None:
    """Wait until the executor holds ``n`` blocks (entered or, in a worker's
    pipe, next in line): what is left is queued in the scheduler."""
    wait_until(lambda: engine.gauges()["held_blocks"] >= n, f"{n} blocks out of the queues")


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


def worker_engine(root: str, n_blocks: int, block_size: int = BS) -> tuple[FsEngine, mmap.mmap]:
    """An engine with 2 I/O worker processes (asserted: no fallback to
    threads) over a memfd primary of ``n_blocks`` rows; the caller shuts it
    down. For tests of what only worker processes do."""
    primary = memfd_primary(n_blocks * block_size)
    settings = TierSettings(
        root_dir=root, io_workers=2, n_read_threads=1, n_write_threads=1, lookup_threads=1
    )
    engine = FsEngine(settings, CacheLayout.for_identity(root, IDENTITY), primary, block_size)
    if engine.io_workers != 2:
        engine.shutdown()
        pytest.fail("worker mode fell back to threads")
    return engine, primary


def round_trip(engine: FsEngine, primary, n_blocks: int) -> None:
    """Store ``pattern(i)`` from every row, zero the buffer, load them all
    back: every byte right."""
    size = engine.block_size
    keys = [make_key(i) for i in range(n_blocks)]
    for i in range(n_blocks):
        fill(primary, i, pattern(i, size), size)
    assert engine.submit_store(1, keys, list(range(n_blocks)))
    assert wait_jobs(engine, [1])[1].success
    primary[:] = bytes(len(primary))
    assert engine.submit_load(2, keys, list(range(n_blocks)))
    assert wait_jobs(engine, [2])[2].success
    assert all(row(primary, i, size) == pattern(i, size) for i in range(n_blocks))
