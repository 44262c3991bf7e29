"""FsEngine's block scheduling without vLLM, with I/O threads and with worker
processes (the io_mode fixture): jobs spread over every place, read priority,
the bounded store queue, drain, shutdown, empty jobs, NUMA pinning."""

from __future__ import annotations

import os
import threading

import pytest

from llmkv_fs.config import TierSettings, store_queue_blocks
from llmkv_fs.engine import Direction, Failure, Outcome
from llmkv_fs.layout.blockfile import TRAILER_SIZE
from tests.kits.engine_kit import (
    BS,
    DEADLINE_S,
    fill,
    held_by_executor,
    inside,
    make_key,
    pattern,
    row,
    store_blocks,
    wait_jobs,
    wait_until,
)
from tests.kits.volume_kit import files_under

# -- thread pool ----------------------------------------------------------------------------


def test_a_jobs_blocks_run_in_four_places_at_once(disk_root, engines, gate_for):
    engine, _, primary = engines(disk_root, n_blocks=8, n_read_threads=2, n_write_threads=2)
    store_blocks(engine, primary, 1, range(4), range(4))
    gate = gate_for(engine)
    engine.submit_load(2, [make_key(i) for i in range(4)], [4, 5, 6, 7])
    gate.wait_entered(4)  # one job, four threads or four worker processes, at once
    assert len({place for place, _kind, _key in gate.entries}) == 4
    gate.open()
    job = wait_jobs(engine, [2])[2]
    assert job.success
    for i in range(4):
        assert row(primary, 4 + i) == pattern(i)


def fill_executor(engine, gate, primary, job_id: int, first_chunk: int) -> list[bytes]:
    """Store blocks until the executor holds as many as it can (every thread
    or every worker place), all held at the gate: what comes next is queued
    in the scheduler, in either mode. Returns their keys."""
    n = inside(engine).executor.capacity()
    keys = [make_key(("fill", first_chunk + i)) for i in range(n)]
    for i in range(n):
        fill(primary, first_chunk + i, pattern(("fill", first_chunk + i)))
    assert engine.submit_store(job_id, keys, list(range(first_chunk, first_chunk + n)))
    held_by_executor(engine, n)
    assert inside(engine).queued_store_blocks() == 0
    return keys


def test_read_priority_places_take_loads_first(disk_root, engines, gate_for):
    engine, _, primary = engines(disk_root, n_blocks=16, n_read_threads=1, n_write_threads=1)
    store_blocks(engine, primary, 1, ["L"], [0])  # the block to load later
    gate = gate_for(engine)
    filled = fill_executor(engine, gate, primary, 10, 1)
    later = [make_key(c) for c in range(10, 16)]
    for n, key in enumerate(later):
        fill(primary, 10 + n, pattern(10 + n))
        assert engine.submit_store(20 + n, [key], [10 + n])
    engine.submit_load(30, [make_key("L")], [9])  # queued behind six stores
    for key in [*later, make_key("L")]:
        gate.hold(key)
    gate.open()
    # The filling blocks go on; each of the two places (a thread, or a
    # worker once its pipe is through) then stops at the first block it
    # took after them, so exactly two arrive, whatever the machine's speed.
    gate.wait_entered(len(filled) + 2)
    first_taken = [key for _place, _kind, key in gate.entries if key not in filled]
    # The read-priority place takes the load submitted last, ahead of the
    # six stores queued before it; in FIFO order both would take stores.
    assert make_key("L") in first_taken, first_taken
    for key in [*later, make_key("L")]:
        gate.release(key)
    done = wait_jobs(engine, [10, 30, *range(20, 26)])
    assert all(job.success for job in done.values())
    assert len(gate.entries) == len(filled) + 7
    assert row(primary, 9) == pattern("L")


# The store queue's bound: in bytes (issue 27: the same memory and latency
# at any chunk size), or the older count of blocks where that is set.
BOUNDS = [{"max_pending_store_bytes": 4 * BS}, {"max_pending_store_blocks": 4}]


@pytest.mark.parametrize("bound", BOUNDS, ids=["bytes", "blocks"])
def test_bounded_store_queue_rejects_without_io(bound, disk_root, engines, gate_for):
    engine, layout, primary = engines(
        disk_root, n_blocks=32, n_read_threads=1, n_write_threads=1, **bound
    )
    for c in range(16):
        fill(primary, c, pattern(c))
    gate = gate_for(engine)
    filled = fill_executor(engine, gate, primary, 1, 16)

    assert engine.submit_store(2, [make_key(c) for c in (2, 3, 4)], [2, 3, 4]) is True
    rejected_keys = [make_key(c) for c in (5, 6, 7)]
    assert engine.submit_store(3, rejected_keys, [5, 6, 7]) is False
    assert inside(engine).queued_store_blocks() == 3
    assert engine.counters[Direction.STORE, Failure.QUEUE_FULL] == 3
    assert engine.has_pending_work()

    (rejected,) = engine.take_finished()  # reported by the very next poll, without I/O
    assert not rejected.success and not rejected.is_load
    assert rejected.failed == rejected_keys and rejected.succeeded == []
    assert rejected.nbytes == 0

    # The bound is inclusive: one more block fills it exactly, the next does not fit.
    assert engine.submit_store(4, [make_key(8)], [8]) is True
    assert engine.submit_store(5, [make_key(9)], [9]) is False
    assert engine.counters[Direction.STORE, Failure.QUEUE_FULL] == 4
    # Loads are not bounded by the store queue.
    engine.submit_load(6, [make_key(c) for c in (10, 11, 12, 13, 14)], [10, 11, 12, 13, 14])

    gate.open()
    done = wait_jobs(engine, [1, 2, 4, 5, 6])
    assert done[1].success and done[2].success and done[4].success
    assert not done[5].success and done[5].failed == [make_key(9)]
    assert engine.counters[Outcome.WRITTEN] == len(filled) + 4
    for key in [*rejected_keys, make_key(9)]:
        assert not os.path.lexists(layout.block_path(key)), "a rejected store reached the disk"
    for c in (2, 3, 4, 8):
        assert os.path.exists(layout.block_path(make_key(c)))
    assert all(
        gate_kind != "store" or key not in rejected_keys for _n, gate_kind, key in gate.entries
    )


@pytest.mark.parametrize("bound", BOUNDS, ids=["bytes", "blocks"])
def test_a_job_larger_than_the_bound_fits_an_empty_queue_only(bound, disk_root, engines, gate_for):
    engine, layout, _primary = engines(
        disk_root, n_blocks=16, n_read_threads=1, n_write_threads=1, **bound
    )
    gate = gate_for(engine)
    big = [make_key(c) for c in range(6)]
    assert engine.submit_store(1, big, list(range(6))) is True  # empty queue: accepted
    held_by_executor(engine, inside(engine).executor.capacity())  # the rest of it is queued
    assert engine.submit_store(2, [make_key(c) for c in range(6, 12)], list(range(6, 12))) is False
    gate.open()
    done = wait_jobs(engine, [1, 2])
    assert done[1].success and not done[2].success
    assert all(os.path.exists(layout.block_path(k)) for k in big)


def test_drain_waits_for_every_job(disk_root, engines, gate_for):
    engine, _, primary = engines(disk_root, n_blocks=16)
    store_blocks(engine, primary, 1, range(4), range(4))
    gate = gate_for(engine)
    for c in range(4, 12):
        fill(primary, c, pattern(c))
    ids = []
    for n in range(4):
        assert engine.submit_store(
            10 + n, [make_key(4 + 2 * n), make_key(5 + 2 * n)], [4 + 2 * n, 5 + 2 * n]
        )
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
    assert engine.counters[Outcome.WRITTEN] == 4 + 8
    assert not engine.has_pending_work()
    for i in range(4):
        assert row(primary, 12 + i) == pattern(i)


def test_shutdown_cancels_queued_blocks_and_leaves_no_partial_files(disk_root, engines, gate_for):
    engine, layout, primary = engines(disk_root, n_blocks=32, n_read_threads=1, n_write_threads=1)
    for c in range(16):
        fill(primary, c, pattern(c))
    gate = gate_for(engine)
    filled = fill_executor(engine, gate, primary, 1, 16)
    queued_store_ids = []
    for n in range(3):
        assert engine.submit_store(
            10 + n, [make_key(2 + 2 * n), make_key(3 + 2 * n)], [2 + 2 * n, 3 + 2 * n]
        )
        queued_store_ids.append(10 + n)
    engine.submit_load(20, [make_key("absent-1"), make_key("absent-2")], [14, 15])

    stopper = threading.Thread(target=engine.shutdown, daemon=True)
    stopper.start()

    def cancelled():  # every place is held at the gate: only shutdown empties the queues
        gauges = engine.gauges()
        return gauges["queued_store_blocks"] == 0 and gauges["queued_load_blocks"] == 0

    wait_until(cancelled, "shutdown to cancel the queues")
    gate.open()
    stopper.join(DEADLINE_S)
    assert not stopper.is_alive(), "shutdown did not return"

    done = wait_jobs(engine, [1, 20, *queued_store_ids], deadline_s=2)
    assert done[1].success  # it was out of the queues: completed, not cut short
    for job_id in queued_store_ids:
        assert not done[job_id].success and len(done[job_id].failed) == 2
    assert sorted(done[20].failed) == sorted([make_key("absent-1"), make_key("absent-2")])
    assert engine.counters[Direction.STORE, Failure.CANCELLED] == 6
    assert engine.counters[Direction.LOAD, Failure.CANCELLED] == 2
    assert engine.counters[Direction.LOAD, Failure.MISSING] == 0  # cancelled, never tried
    assert engine.counters[Outcome.WRITTEN] == len(filled)
    assert {key for _p, _kind, key in gate.entries} == set(filled)  # nothing queued ran

    files = files_under(layout.rank_dir)
    assert not [f for f in files if f.endswith(".tmp")], files
    blocks = [f for f in files if f.endswith(".bin")]
    assert sorted(blocks) == sorted(layout.block_path(key) for key in filled)
    for path in blocks:
        assert os.path.getsize(path) == BS + TRAILER_SIZE
    with pytest.raises(RuntimeError):
        engine.submit_load(99, [make_key(0)], [0])


@pytest.mark.parametrize("is_load", [False, True])
def test_empty_job_finishes(disk_root, engines, is_load):
    engine, _, _ = engines(disk_root, n_blocks=2)
    if is_load:
        engine.submit_load(7, [], [])
    else:
        assert engine.submit_store(7, [], [])
    job = wait_jobs(engine, [7], deadline_s=2)[7]
    assert job.success and job.nbytes == 0
    assert not engine.has_pending_work()


# -- NUMA placement ---------------------------------------------------------------------


def test_io_threads_pin_to_the_node_holding_the_primary_buffer(disk_root, engines, monkeypatch):
    """A two-node topology (faked: this machine has one node) whose node 1
    owns one real CPU; the buffer is reported on node 1. Every I/O thread
    (or worker process) must then run on exactly that CPU."""
    from llmkv_fs.engine import engine as engine_module
    from llmkv_fs.engine.startup import numa

    cpus = sorted(os.sched_getaffinity(0))
    node1 = frozenset(cpus[-1:])
    node0 = frozenset(cpus) - node1 or frozenset({max(cpus) + 1})
    fake = numa.NumaTopology(nodes={0: node0, 1: node1}, allowed_cpus=frozenset(cpus))
    monkeypatch.setattr(engine_module, "read_topology", lambda: fake)
    monkeypatch.setattr(numa, "node_of_buffer", lambda buf, samples=8: 1)
    # compiled_io off: BlockIO.store is wrapped in-process below
    engine, _layout, primary = engines(disk_root, n_blocks=8, compiled_io=False)
    assert engine.pinning.cpus == node1 and engine.pinning.node == 1
    if engines.mode.workers:  # each worker pins itself to the CPUs it was given
        pids = inside(engine).executor.worker_pids()
        assert pids and all(frozenset(os.sched_getaffinity(pid)) == node1 for pid in pids)
        store_blocks(engine, primary, 1, range(8), range(8))
        return
    seen = []
    real_store = engine.roots[0].blockio.store

    def record(key, row_view, *rest):
        seen.append(frozenset(os.sched_getaffinity(0)))
        return real_store(key, row_view, *rest)

    monkeypatch.setattr(engine.roots[0].blockio, "store", record)
    store_blocks(engine, primary, 1, range(8), range(8))
    assert seen and set(seen) == {node1}
    assert frozenset(os.sched_getaffinity(0)) == frozenset(cpus)  # the caller is untouched


def test_a_second_shutdown_closes_no_one_elses_descriptors(disk_root, engines):
    """Shutdown is idempotent: a second call (a test's own plus the
    fixture's, or a caller retrying) must not close fd numbers the first one
    freed and someone else got since (found: a later engine's worker spawn
    failed with EBADF)."""
    engine, _, _ = engines(disk_root)
    engine.shutdown()
    others = [os.open(os.devnull, os.O_RDONLY) for _ in range(64)]  # the freed numbers
    try:
        engine.shutdown()
        for fd in others:
            os.fstat(fd)  # EBADF if the second shutdown closed it
    finally:
        for fd in others:
            os.close(fd)


def _engine_memfds() -> int:
    """Descriptors of this process on the engine's memfds (volume signals,
    the workers' cancel board)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own fd, closed by now
        count += target.startswith("/memfd:llmkv_fs_")
    return count


def test_a_shut_down_engine_holds_no_descriptor_and_still_answers(disk_root, engines):
    """Issue 25: Python's mmap keeps a duplicate of the fd it maps, so the
    volume-signals page held one descriptor per root after shutdown, until
    the engine object was collected. What a shut-down engine is still asked
    (its roots' state) is answered without one."""
    before = _engine_memfds()
    engine, _, _ = engines(f"{disk_root}/a,{disk_root}/b", path_sharding="by_block_hash")
    assert _engine_memfds() > before
    engine.shutdown()
    assert _engine_memfds() == before
    gauges = engine.root_gauges()
    assert [g["volume_failed"] for g in gauges.values()] == [0, 0]
    assert [g["space_guard_tripped"] for g in gauges.values()] == [0, 0]


def test_the_default_store_bound_is_the_same_memory_at_any_chunk_size():
    """Issue 27: 2 GiB of queued stores, 1,024 chunks of 2 MiB or 32,768 of
    64 KiB (the old count, 1,024 blocks, was 64 MiB at 64 KiB: a 2,048-block
    burst lost half its stores); a count set explicitly still bounds it."""
    settings = TierSettings(root_dir="/r")
    assert store_queue_blocks(settings, 2 << 20) == 1024
    assert store_queue_blocks(settings, 64 << 10) == 32768
    assert (
        store_queue_blocks(TierSettings(root_dir="/r", max_pending_store_blocks=8), 64 << 10) == 8
    )
    assert store_queue_blocks(TierSettings(root_dir="/r", max_pending_store_bytes=1), 2 << 20) == 1
