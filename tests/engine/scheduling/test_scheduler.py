"""The block scheduler on its own (engine/scheduling/scheduler.py), driven
through its two sides with a fake executor: the test is every place of the
executor at once, taking slices and giving them back when it chooses. No
thread, no file, no clock but the one passed to ``expire_overdue``: each
rule of the scheduler's module doc is checked by the state it leaves."""

from __future__ import annotations

import pytest

from llmkv_fs.engine.outcomes import CANCELLED, DEADLINE, SKIPPED, Failed, Failure, Outcome
from llmkv_fs.engine.scheduling.scheduler import BlockScheduler, BlockSlice, IoJob, QueueFull

MISSING = Failed(Failure.MISSING)


class FakeExecutor:
    """Implements the executor protocol (scheduling/scheduler.py) and moves
    nothing: it records what the scheduler told it."""

    def __init__(self, places: int):
        self.places = places
        self.source = None
        self.arrived: list[int] = []
        self.expired: list[IoJob] = []
        self.stopped = False

    def start(self, source) -> None:
        self.source = source

    def work_arrived(self, blocks: int) -> None:
        self.arrived.append(blocks)

    def job_expired(self, job: IoJob) -> None:
        self.expired.append(job)

    def stop(self) -> None:
        self.stopped = True

    def capacity(self) -> int:
        return self.places

    def worker_pids(self) -> list[int]:
        return []

    def deaths(self) -> int:
        return 0


def scheduler(places: int = 2, slice_blocks: int = 1, max_stores: int = 100, least: int = 1):
    sched = BlockScheduler(max_stores, slice_blocks, least_slice_blocks=least)
    executor = FakeExecutor(places)
    sched.start(executor)
    return sched, executor


def job(job_id: int, is_load: bool, n: int, timeout: float | None = None) -> tuple:
    """What ``BlockScheduler.submit`` takes for a job of ``n`` blocks."""
    keys = [bytes([job_id, i]) * 18 for i in range(n)]
    return job_id, is_load, keys, list(range(n)), timeout


def done(sched: BlockScheduler, taken: BlockSlice, result=None) -> None:
    ok = Outcome.VERIFIED if taken.job.is_load else Outcome.WRITTEN
    sched.slice_done(taken, [result or ok] * taken.n_blocks)


def test_the_executor_is_started_and_told_of_every_block_queued():
    sched, executor = scheduler(places=3)
    assert executor.source is sched and sched.places == 3
    sched.submit(*job(1, False, 4))
    sched.submit(*job(2, True, 2))
    assert executor.arrived == [4, 2]
    assert sched.queued_store_blocks() == 4 and sched.queued_load_blocks() == 2


def test_a_place_asking_loads_first_gets_loads_before_older_stores_and_vice_versa():
    sched, _ = scheduler()
    sched.submit(*job(1, False, 1))
    sched.submit(*job(2, True, 1))
    first = sched.take(load_first=True)
    assert first is not None and first.job.job_id == 2
    second = sched.take(load_first=True)
    assert second is not None and second.job.job_id == 1  # no load left: a store
    assert sched.take(load_first=False) is None


def test_a_job_is_reported_once_when_its_last_block_is_back():
    sched, _ = scheduler()
    stored = sched.submit(*job(1, False, 2))
    a, b = sched.take(False), sched.take(False)
    assert a is not None and b is not None
    done(sched, b)
    assert sched.take_finished() == [] and sched.busy()
    done(sched, a)
    assert sched.take_finished() == [stored]
    assert stored.outcomes == [Outcome.WRITTEN, Outcome.WRITTEN]
    assert not sched.busy() and sched.take_finished() == []


def test_slices_grow_only_when_every_place_can_get_as_many_twice_over():
    sched, _ = scheduler(places=2, slice_blocks=16)
    sched.submit(*job(1, True, 3))  # 3 blocks for 2 places: one block each
    taken = sched.take(True)
    assert taken is not None and taken.n_blocks == 1
    sched, _ = scheduler(places=2, slice_blocks=16)
    sched.submit(*job(2, True, 64))  # 64 // (2 * 2) = 16: the cap
    taken = sched.take(True)
    assert taken is not None and taken.n_blocks == 16
    assert sched.blocks_in_flight() == 16 and sched.busy_places() == 1


def test_a_lone_small_job_spreads_in_slices_no_smaller_than_the_least():
    sched, _ = scheduler(places=8, slice_blocks=16, least=16)
    sched.submit(*job(1, True, 32))  # 32 // (2 * 8) = 2, but a slice is worth 16
    shapes = []
    while (taken := sched.take(True)) is not None:
        shapes.append((taken.first, taken.n_blocks))
    assert shapes == [(0, 16), (16, 16)]
    sched, _ = scheduler(places=8, slice_blocks=16, least=16)
    sched.submit(*job(2, True, 5))  # fewer than the least: one slice
    taken = sched.take(True)
    assert taken is not None and taken.n_blocks == 5 and sched.take(True) is None


def test_the_least_slice_never_exceeds_the_most():
    sched, _ = scheduler(places=2, slice_blocks=4, least=16)
    sched.submit(*job(1, True, 32))
    taken = sched.take(True)
    assert taken is not None and taken.n_blocks == 4


def test_a_failed_load_block_skips_the_blocks_not_handed_out_yet():
    sched, _ = scheduler()
    load = sched.submit(*job(1, True, 4))
    first, second = sched.take(True), sched.take(True)
    assert first is not None and second is not None
    done(sched, first, MISSING)
    assert sched.take(True) is None  # blocks 2 and 3 are never read
    assert load.outcomes[2:] == [SKIPPED, SKIPPED]
    done(sched, second)  # the block already out runs to its end
    assert sched.take_finished() == [load]
    assert load.outcomes[:2] == [MISSING, Outcome.VERIFIED]


def test_a_store_job_over_the_queue_bound_is_refused_whole_unless_the_queue_is_empty():
    sched, executor = scheduler(max_stores=4)
    sched.submit(*job(1, False, 6))  # alone: a long prompt must still be storable
    with pytest.raises(QueueFull):
        sched.submit(*job(2, False, 1))
    assert executor.arrived == [6] and sched.queued_store_blocks() == 6
    sched.submit(*job(3, True, 8))  # loads are never bounded


def test_an_overdue_store_is_reported_at_once_and_its_blocks_out_become_stuck():
    sched, executor = scheduler()
    store = sched.submit(*job(1, False, 3, timeout=5.0))
    out = sched.take(False)
    assert out is not None and out.n_blocks == 1
    assert sched.expire_overdue(now=store.submitted + 1.0) == 0
    assert sched.expire_overdue(now=store.submitted + 6.0) == 3
    assert executor.expired == [store] and store.cancelled[0]
    assert sched.take_finished() == [store] and store.outcomes == [DEADLINE] * 3
    assert sched.stuck_blocks == 1  # the volume has not answered that block
    done(sched, out)  # answered at last: not stuck, not reported twice
    assert sched.stuck_blocks == 0 and sched.take_finished() == []


def test_an_overdue_load_is_reported_only_when_its_blocks_out_are_back():
    """The kernel may still write into a row of a block out: vLLM must not
    reuse it before the block is back."""
    sched, executor = scheduler()
    load = sched.submit(*job(1, True, 2, timeout=5.0))
    out = sched.take(True)
    assert out is not None
    assert sched.expire_overdue(now=load.submitted + 6.0) == 1  # the queued one
    assert executor.expired == [load] and sched.take_finished() == []
    done(sched, out)  # a read that completed late is as good as ever
    assert sched.take_finished() == [load]
    assert load.outcomes == [Outcome.VERIFIED, DEADLINE]


def test_shutdown_cancels_what_is_queued_and_stops_the_executor():
    sched, executor = scheduler()
    queued = sched.submit(*job(1, False, 2))
    sched.shutdown()
    assert executor.stopped and sched.stopping
    assert sched.take(False) is None
    assert sched.take_finished() == [queued] and queued.outcomes == [CANCELLED] * 2
    with pytest.raises(RuntimeError):
        sched.submit(*job(2, True, 1))


def test_an_empty_job_is_finished_at_once():
    sched, executor = scheduler()
    empty = sched.submit(*job(1, True, 0))
    assert executor.arrived == [] and sched.take_finished() == [empty]


def test_a_slice_given_back_with_the_wrong_number_of_results_is_refused():
    sched, _ = scheduler()
    sched.submit(*job(1, False, 1))
    taken = sched.take(False)
    assert taken is not None
    with pytest.raises(ValueError):
        sched.slice_done(taken, [])
