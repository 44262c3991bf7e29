"""FsEngine without vLLM: block I/O on the two-priority pool, bounded store
queue, drain/shutdown, verification and quarantine, batched lookups.

Never imports vllm or torch. Waiting is polling with a deadline; threads are
held with Events/Barriers that carry timeouts, never with sleeps.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import subprocess
import sys
import threading
import time

import pytest

from llmkv_fs.config import TierSettings
from llmkv_fs.engine.engine import EngineError, FinishedJob, FsEngine, prepare_volume
from llmkv_fs.layout.blockfile import TRAILER_SIZE, unpack_trailer
from llmkv_fs.layout.paths import CacheLayout, RunIdentity

BS = 64 * 1024
DEADLINE_S = 20.0
GATE_TIMEOUT_S = 15.0
IDENTITY = RunIdentity(
    model_name="m/x", dtype="bfloat16", tokens_per_hash=16, blocks_per_file=1,
    kv_cache_groups=((16, ("l0",)),),
)


def make_key(i, group: int = 0) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest() + group.to_bytes(4, "big")


def pattern(i, size: int = BS) -> bytes:
    unit = hashlib.sha256(f"payload-{i}".encode()).digest()
    return (unit * (size // len(unit) + 1))[:size]


def fill(primary, chunk: int, data: bytes, block_size: int = BS) -> None:
    primary[chunk * block_size:(chunk + 1) * block_size] = data


def row(primary, chunk: int, block_size: int = BS) -> bytes:
    return primary[chunk * block_size:(chunk + 1) * block_size]


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


def files_under(directory: str) -> list[str]:
    found = []
    for parent, _dirs, names in os.walk(directory):
        found.extend(os.path.join(parent, n) for n in names)
    return found


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
            def wrapper(key, row_view):
                with self._cond:
                    self.entries.append((threading.current_thread().name, kind, key))
                    self._cond.notify_all()
                if kind == "load":
                    self.load_entered.set()
                self.opened.wait(GATE_TIMEOUT_S)
                extra = self.extra_wait.get(key)
                if extra is not None:
                    extra.wait(GATE_TIMEOUT_S)
                return real(key, row_view)
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
        prepare_volume(layout)
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


# -- round trip ---------------------------------------------------------------------------


def test_store_then_load_round_trip(volume, engines):
    engine, layout, primary = engines(volume, n_blocks=16)
    ids = list(range(6))
    keys = [make_key(i) for i in ids]
    for chunk, i in enumerate(ids):
        fill(primary, chunk, pattern(i))
    assert engine.submit_store(1, keys, list(range(6)))
    stored = wait_jobs(engine, [1])[1]
    assert stored.success and not stored.is_load
    assert sorted(stored.succeeded) == sorted(keys) and stored.failed == []
    assert stored.nbytes == 6 * BS
    assert engine.counters["blocks_written"] == 6
    assert engine.counters["bytes_written"] == 6 * BS
    for key in keys:
        assert os.path.getsize(layout.block_path(key)) == BS + TRAILER_SIZE

    primary[:] = bytes(len(primary))
    targets = [15, 9, 8, 12, 10, 11]  # other rows, scrambled
    engine.submit_load(2, keys, targets)
    loaded = wait_jobs(engine, [2])[2]
    assert loaded.success and loaded.is_load and loaded.nbytes == 6 * BS
    for i, chunk in zip(ids, targets):
        assert row(primary, chunk) == pattern(i), f"block {i} came back wrong"
    for chunk in range(6):
        assert row(primary, chunk) == bytes(BS)  # rows not loaded into stay zero
    assert engine.counters["blocks_verified"] == 6
    assert engine.counters["bytes_read"] == 6 * BS
    assert loaded.io_seconds >= 0.0

    # Storing the same keys again finds them present: nothing moved.
    assert engine.submit_store(3, keys[:2], [15, 9])
    again = wait_jobs(engine, [3])[3]
    assert again.success and again.nbytes == 0
    assert engine.counters["blocks_present"] == 2
    assert engine.counters["bytes_written"] == 6 * BS
    assert not engine.has_pending_work()


# -- I/O mode -------------------------------------------------------------------------------


def test_o_direct_chosen_on_tmpfs_and_ext4(volume, engines):
    engine, _, _ = engines(volume, n_blocks=2)
    assert engine.use_o_direct is True
    assert engine.blockio.options.use_o_direct is True


def test_buffered_mode_never_uses_o_direct(volume, engines):
    engine, _, primary = engines(volume, n_blocks=2, io_mode="buffered")
    assert engine.use_o_direct is False
    assert engine.blockio.options.use_o_direct is False
    store_blocks(engine, primary, 1, [0], [0])


def test_direct_mode_with_unaligned_block_size_raises(disk_root):
    block_size = 4096 + 512
    layout = CacheLayout.for_identity(disk_root, IDENTITY)
    prepare_volume(layout)
    primary = mmap.mmap(-1, 4 * block_size)
    settings = TierSettings(root_dir=disk_root, io_mode="direct", n_read_threads=1,
                            n_write_threads=1, lookup_threads=1)
    with pytest.raises(EngineError) as info:
        FsEngine(settings, layout, primary, block_size)
    message = str(info.value)
    assert "io_mode=direct" in message
    assert "not page aligned" in message
    assert "buffered" in message  # tells the fix


def test_auto_mode_with_unaligned_block_size_falls_back(disk_root, engines):
    block_size = 4096 + 512
    engine, _, primary = engines(disk_root, n_blocks=4, block_size=block_size)
    assert engine.use_o_direct is False
    data = pattern("odd", block_size)
    primary[block_size:2 * block_size] = data
    assert engine.submit_store(1, [make_key("odd")], [1])
    assert wait_jobs(engine, [1])[1].success
    primary[:] = bytes(len(primary))
    engine.submit_load(2, [make_key("odd")], [3])
    assert wait_jobs(engine, [2])[2].success
    assert primary[3 * block_size:4 * block_size] == data


def test_buffer_not_whole_blocks_raises(disk_root):
    layout = CacheLayout.for_identity(disk_root, IDENTITY)
    prepare_volume(layout)
    with pytest.raises(EngineError, match="whole number"):
        FsEngine(TierSettings(root_dir=disk_root), layout, mmap.mmap(-1, BS + 4096), BS)


def test_prepare_volume_refuses_missing_root(tmp_path):
    layout = CacheLayout.for_identity(str(tmp_path / "not-mounted"), IDENTITY)
    with pytest.raises(EngineError, match="does not exist"):
        prepare_volume(layout)
    assert not (tmp_path / "not-mounted").exists()


# -- thread pool ----------------------------------------------------------------------------


def test_job_blocks_run_on_four_threads_at_once(disk_root, engines, monkeypatch):
    engine, _, primary = engines(disk_root, n_blocks=8, n_read_threads=2, n_write_threads=2)
    store_blocks(engine, primary, 1, range(4), range(4))
    barrier = threading.Barrier(4, timeout=10)
    names = []
    real_load = engine.blockio.load

    def load_together(key, row_view):
        names.append(threading.current_thread().name)
        barrier.wait()  # breaks (and the block fails) unless 4 threads are here
        return real_load(key, row_view)

    monkeypatch.setattr(engine.blockio, "load", load_together)
    engine.submit_load(2, [make_key(i) for i in range(4)], [4, 5, 6, 7])
    job = wait_jobs(engine, [2])[2]
    assert job.success, f"blocks did not run concurrently: failed {len(job.failed)}"
    assert len(set(names)) == 4, names
    for i in range(4):
        assert row(primary, 4 + i) == pattern(i)


def test_read_priority_thread_takes_loads_first(disk_root, engines, gate_for):
    engine, _, primary = engines(disk_root, n_blocks=16, n_read_threads=1, n_write_threads=1)
    store_blocks(engine, primary, 1, ["L"], [0])  # the block to load later
    gate = gate_for(engine)
    for c in range(1, 9):
        fill(primary, c, pattern(c))
    # Occupy both threads.
    assert engine.submit_store(10, [make_key(1), make_key(2)], [1, 2])
    gate.wait_entered(2)
    # Later stores also wait for the load to start: if the read-priority
    # thread wrongly picked a store, both threads would sit in stores and the
    # order below would show it.
    later = [make_key(c) for c in range(3, 9)]
    for key in later:
        gate.extra_wait[key] = gate.load_entered
    for n, key in enumerate(later):
        assert engine.submit_store(20 + n, [key], [3 + n])
    engine.submit_load(30, [make_key("L")], [9])
    gate.open()
    done = wait_jobs(engine, [10, 30, *range(20, 26)])
    assert all(job.success for job in done.values())
    by_thread: dict[str, list[str]] = {}
    for name, kind, _key in gate.entries:
        by_thread.setdefault(name[-2:], []).append(kind)
    assert set(by_thread) == {"r0", "w0"}, by_thread
    assert by_thread["r0"][0] == "store" and by_thread["w0"][0] == "store"  # the gated pair
    assert by_thread["r0"][1] == "load", f"read-priority thread ran {by_thread['r0']}"
    assert by_thread["w0"][1] == "store", f"write-priority thread ran {by_thread['w0']}"
    assert row(primary, 9) == pattern("L")


def test_bounded_store_queue_rejects_without_io(disk_root, engines, gate_for):
    engine, layout, primary = engines(
        disk_root, n_blocks=16, n_read_threads=1, n_write_threads=1, max_pending_store_blocks=4,
    )
    for c in range(16):
        fill(primary, c, pattern(c))
    gate = gate_for(engine)
    assert engine.submit_store(1, [make_key(0), make_key(1)], [0, 1])
    gate.wait_entered(2)  # both threads held; the store queue is empty
    assert engine.queued_store_blocks() == 0

    assert engine.submit_store(2, [make_key(c) for c in (2, 3, 4)], [2, 3, 4]) is True
    rejected_keys = [make_key(c) for c in (5, 6, 7)]
    assert engine.submit_store(3, rejected_keys, [5, 6, 7]) is False
    assert engine.queued_store_blocks() == 3
    assert engine.counters["store_blocks_dropped_queue_full"] == 3
    assert engine.has_pending_work()

    rejected = wait_jobs(engine, [3], deadline_s=0.5)[3]  # reported at once
    assert not rejected.success and not rejected.is_load
    assert rejected.failed == rejected_keys and rejected.succeeded == []
    assert rejected.nbytes == 0

    # The bound is inclusive: one more block fills it exactly, the next does not fit.
    assert engine.submit_store(4, [make_key(8)], [8]) is True
    assert engine.submit_store(5, [make_key(9)], [9]) is False
    assert engine.counters["store_blocks_dropped_queue_full"] == 4
    # Loads are not bounded by the store queue.
    engine.submit_load(6, [make_key(c) for c in (10, 11, 12, 13, 14)], [10, 11, 12, 13, 14])

    gate.open()
    done = wait_jobs(engine, [1, 2, 4, 5, 6])
    assert done[1].success and done[2].success and done[4].success
    assert not done[5].success and done[5].failed == [make_key(9)]
    assert engine.counters["blocks_written"] == 6
    for key in rejected_keys + [make_key(9)]:
        assert not os.path.lexists(layout.block_path(key)), "a rejected store reached the disk"
    for c in (0, 1, 2, 3, 4, 8):
        assert os.path.exists(layout.block_path(make_key(c)))
    assert all(gate_kind != "store" or key not in rejected_keys
               for _n, gate_kind, key in gate.entries)


def test_drain_waits_for_every_job(disk_root, engines, gate_for):
    engine, _, primary = engines(disk_root, n_blocks=16)
    store_blocks(engine, primary, 1, range(4), range(4))
    gate = gate_for(engine)
    for c in range(4, 12):
        fill(primary, c, pattern(c))
    ids = []
    for n in range(4):
        assert engine.submit_store(10 + n, [make_key(4 + 2 * n), make_key(5 + 2 * n)],
                                   [4 + 2 * n, 5 + 2 * n])
        ids.append(10 + n)
    engine.submit_load(20, [make_key(i) for i in range(4)], [12, 13, 14, 15])
    ids.append(20)
    gate.wait_entered(4)

    drainer = threading.Thread(target=engine.drain, daemon=True)
    drainer.start()
    drainer.join(0.3)
    assert drainer.is_alive(), "drain returned while blocks were still held"
    assert engine.take_finished() == []
    gate.open()
    drainer.join(DEADLINE_S)
    assert not drainer.is_alive()

    finished = engine.take_finished()  # one call: everything is already there
    assert sorted(job.job_id for job in finished) == sorted(ids)
    assert all(job.success for job in finished)
    assert engine.counters["blocks_written"] == 4 + 8
    assert not engine.has_pending_work()
    for i in range(4):
        assert row(primary, 12 + i) == pattern(i)


def test_shutdown_cancels_queued_blocks_and_leaves_no_partial_files(disk_root, engines, gate_for):
    engine, layout, primary = engines(disk_root, n_blocks=16, n_read_threads=1, n_write_threads=1)
    for c in range(16):
        fill(primary, c, pattern(c))
    gate = gate_for(engine)
    assert engine.submit_store(1, [make_key(0), make_key(1)], [0, 1])
    gate.wait_entered(2)
    queued_store_ids = []
    for n in range(3):
        assert engine.submit_store(10 + n, [make_key(2 + 2 * n), make_key(3 + 2 * n)],
                                   [2 + 2 * n, 3 + 2 * n])
        queued_store_ids.append(10 + n)
    engine.submit_load(20, [make_key("absent-1"), make_key("absent-2")], [14, 15])

    stopper = threading.Thread(target=engine.shutdown, daemon=True)
    stopper.start()
    pool = engine._pool

    def stopping():
        with pool._cond:  # set and queues cleared under this lock
            return pool._stopping

    wait_until(stopping, "shutdown to cancel the queues")
    gate.open()
    stopper.join(DEADLINE_S)
    assert not stopper.is_alive(), "shutdown did not return"

    done = wait_jobs(engine, [1, 20, *queued_store_ids], deadline_s=2)
    assert done[1].success  # it was running: completed, not cut short
    for job_id in queued_store_ids:
        assert not done[job_id].success and len(done[job_id].failed) == 2
    assert sorted(done[20].failed) == sorted([make_key("absent-1"), make_key("absent-2")])
    assert engine.counters["store_cancelled"] == 6
    assert engine.counters["load_cancelled"] == 2
    assert engine.counters["load_missing"] == 0  # cancelled, never tried
    assert engine.counters["blocks_written"] == 2
    assert len(gate.entries) == 2  # nothing ran after the first two blocks

    files = files_under(layout.rank_dir)
    assert not [f for f in files if f.endswith(".tmp")], files
    blocks = [f for f in files if f.endswith(".bin")]
    assert sorted(blocks) == sorted(layout.block_path(make_key(c)) for c in (0, 1))
    for path in blocks:
        assert os.path.getsize(path) == BS + TRAILER_SIZE
    with pytest.raises(RuntimeError):
        engine.submit_load(99, [make_key(0)], [0])


# -- verification, quarantine, trailer-less files -------------------------------------------


def test_missing_file_load_fails(disk_root, engines):
    engine, _, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 1, [0], [0])
    engine.submit_load(2, [make_key(0), make_key("nope")], [1, 2])
    job = wait_jobs(engine, [2])[2]
    assert not job.success
    assert job.failed == [make_key("nope")] and job.succeeded == [make_key(0)]
    assert job.nbytes == BS
    assert engine.counters["load_missing"] == 1
    assert engine.counters["quarantined"] == 0
    assert row(primary, 1) == pattern(0)


@pytest.mark.parametrize("offset, reason", [
    (12345, "bad-checksum"),           # payload bit flip
    (BS + 50, "bad-trailer"),          # inside the trailer's key
    (BS + 0, "bad-magic"),
])
def test_corrupt_file_is_quarantined(disk_root, engines, offset, reason):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 1, [0], [0])
    path = layout.block_path(make_key(0))
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x08]))
    engine.submit_load(2, [make_key(0)], [1])
    job = wait_jobs(engine, [2])[2]
    assert not job.success and job.failed == [make_key(0)] and job.nbytes == 0
    assert engine.counters["quarantined"] == 1
    assert engine.counters[f"load_corrupt_{reason}"] == 1
    assert not os.path.lexists(path)
    moved = os.listdir(layout.quarantine_dir)
    assert len(moved) == 1
    assert moved[0].startswith(os.path.basename(path)) and f".{reason}." in moved[0]
    assert os.path.getsize(os.path.join(layout.quarantine_dir, moved[0])) == BS + TRAILER_SIZE
    # The quarantined block is gone for lookups and for a second load.
    assert settle(engine, make_key(0), "req") is False
    engine.submit_load(3, [make_key(0)], [1])
    assert not wait_jobs(engine, [3])[3].success
    assert engine.counters["load_missing"] == 1


def test_truncated_file_is_quarantined(disk_root, engines):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 1, [0], [0])
    path = layout.block_path(make_key(0))
    os.truncate(path, BS // 2)
    engine.submit_load(2, [make_key(0)], [1])
    assert not wait_jobs(engine, [2])[2].success
    assert engine.counters["load_corrupt_truncated"] == 1
    assert not os.path.lexists(path)
    assert len(os.listdir(layout.quarantine_dir)) == 1


def test_trailerless_file_loads_unverified(volume, engines):
    engine, layout, primary = engines(volume, n_blocks=4)
    key = make_key("vllm-builtin")
    path = layout.block_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(pattern("raw"))
    assert settle(engine, key, "req") is True
    engine.submit_load(1, [key], [2])
    job = wait_jobs(engine, [1])[1]
    assert job.success and job.nbytes == BS
    assert row(primary, 2) == pattern("raw")
    assert engine.counters["blocks_unverified"] == 1
    assert engine.counters["blocks_verified"] == 0
    assert engine.counters["bytes_read"] == BS
    # A store of that key treats the existing file as present.
    assert engine.submit_store(2, [key], [0])
    assert wait_jobs(engine, [2])[2].success
    assert engine.counters["blocks_present"] == 1
    assert os.path.getsize(path) == BS


# -- lookups ----------------------------------------------------------------------------------


def test_lookup_verdicts_follow_loads_and_stores(disk_root, engines):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 1, ["here"], [0])
    here, absent = make_key("here"), make_key("absent")

    assert engine.lookup(here, "req") is None
    assert engine.lookup(absent, "req") is None
    assert engine.lookup(here, "req") is None  # not answered before end_step
    assert settle(engine, here, "req") is True
    assert settle(engine, absent, "req") is False
    assert engine._lookups.tracked_keys() == 2

    # The file disappears; a load fails and the held verdict flips to False.
    os.unlink(layout.block_path(here))
    engine.submit_load(2, [here], [1])
    assert not wait_jobs(engine, [2])[2].success
    assert engine.lookup(here, "req") is False

    # A store lands for a key held as False: it flips to True.
    fill(primary, 2, pattern("absent"))
    assert engine.submit_store(3, [absent], [2])
    assert wait_jobs(engine, [3])[3].success
    assert engine.lookup(absent, "req") is True

    engine.forget_request("req")
    assert engine._lookups.tracked_keys() == 0
    # A new request asks again from scratch.
    assert engine.lookup(absent, "req2") is None
    assert settle(engine, absent, "req2") is True
    engine.forget_request("req2")
    assert engine._lookups.tracked_keys() == 0


def test_lookup_batch_over_parallel_threshold(disk_root, engines):
    engine, _, primary = engines(disk_root, n_blocks=16, lookup_threads=4)
    store_blocks(engine, primary, 1, range(6), range(6))
    keys = [make_key(i) for i in range(12)]  # 6 stored, 6 not: one batch of 12
    assert all(engine.lookup(k, "r") is None for k in keys)
    verdicts = [settle(engine, k, "r") for k in keys]
    assert verdicts == [True] * 6 + [False] * 6
    engine.forget_request("r")
    assert engine._lookups.tracked_keys() == 0


def test_key_shared_by_two_requests_survives_one_forget(disk_root, engines):
    engine, _, primary = engines(disk_root, n_blocks=2)
    store_blocks(engine, primary, 1, [0], [0])
    assert settle(engine, make_key(0), "a") is True
    assert engine.lookup(make_key(0), "b") is True  # verdict shared
    engine.forget_request("a")
    assert engine._lookups.tracked_keys() == 1
    assert engine.lookup(make_key(0), "b") is True
    engine.forget_request("b")
    assert engine._lookups.tracked_keys() == 0


def test_planted_symlink_is_not_a_block(disk_root, engines, tmp_path):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    key = make_key("linked")
    store_blocks(engine, primary, 1, ["linked"], [0])  # a valid file for this very key
    path = layout.block_path(key)
    elsewhere = str(tmp_path / "elsewhere.bin")
    os.rename(path, elsewhere)
    os.symlink(elsewhere, path)

    assert settle(engine, key, "req") is False
    engine.submit_load(2, [key], [1])
    job = wait_jobs(engine, [2])[2]
    assert not job.success and job.failed == [key]
    assert row(primary, 1) == bytes(BS)  # nothing was read through the link
    assert engine.counters["blocks_verified"] == 0
    # The target was neither read into a successful load nor moved.
    assert os.path.getsize(elsewhere) == BS + TRAILER_SIZE
    with open(elsewhere, "rb") as f:
        assert unpack_trailer(f.read()[BS:]).key == key


def test_symlink_refusal_is_not_counted_as_quarantined(disk_root, engines, tmp_path):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    key = make_key("linked")
    store_blocks(engine, primary, 1, ["linked"], [0])
    path = layout.block_path(key)
    elsewhere = str(tmp_path / "elsewhere.bin")
    os.rename(path, elsewhere)
    os.symlink(elsewhere, path)
    engine.submit_load(2, [key], [1])
    assert not wait_jobs(engine, [2])[2].success
    assert os.path.islink(path)  # left in place
    in_quarantine = (
        os.listdir(layout.quarantine_dir) if os.path.isdir(layout.quarantine_dir) else []
    )
    assert engine.counters["quarantined"] == len(in_quarantine) == 0


# -- misc ---------------------------------------------------------------------------------------


def test_engine_and_layout_import_without_vllm_or_torch():
    code = (
        "import sys, llmkv_fs.engine.engine, llmkv_fs.layout, llmkv_fs.config; "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('vllm','torch'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("is_load", [False, True], ids=["store", "load"])
def test_chunk_outside_buffer_fails_that_block_only(disk_root, engines, caplog, is_load):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    ids = [0, 1, 2, 3]
    keys = [make_key(i) for i in ids]
    if is_load:
        store_blocks(engine, primary, 1, [0, 3], [0, 3])
        primary[:] = bytes(len(primary))
        engine.submit_load(2, keys, [2, 4, -1, 1])
    else:
        for c, i in zip([0, 4, -1, 1], ids):
            if 0 <= c < 4:
                fill(primary, c, pattern(i))
        assert engine.submit_store(2, keys, [0, 4, -1, 1])
    with caplog.at_level(logging.WARNING, logger="vllm.llmkv_fs.engine"):
        job = wait_jobs(engine, [2])[2]
    assert sorted(job.failed) == sorted([keys[1], keys[2]])
    assert sorted(job.succeeded) == sorted([keys[0], keys[3]])
    direction = "load" if is_load else "store"
    assert engine.counters[f"{direction}_errors"] == 2
    assert caplog.text.count("IndexError") == 2, caplog.text
    if is_load:
        assert row(primary, 2) == pattern(0) and row(primary, 1) == pattern(3)
        assert row(primary, 3) == bytes(BS)  # the -1 chunk did not wrap to the last row
    else:
        assert not os.path.lexists(layout.block_path(keys[1]))
        assert not os.path.lexists(layout.block_path(keys[2]))
        assert os.path.exists(layout.block_path(keys[3]))


@pytest.mark.parametrize("is_load", [False, True], ids=["store", "load"])
def test_empty_job_finishes(disk_root, engines, is_load):
    engine, _, _ = engines(disk_root, n_blocks=2)
    if is_load:
        engine.submit_load(7, [], [])
    else:
        assert engine.submit_store(7, [], [])
    job = wait_jobs(engine, [7], deadline_s=2)[7]
    assert job.success and job.nbytes == 0
    assert not engine.has_pending_work()
