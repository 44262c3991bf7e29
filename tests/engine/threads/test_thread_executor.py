"""The I/O-thread executor (engine/threads/thread_executor.py) with the real
scheduler and a stand-in block step: what it promises is who takes what and
that nothing is lost or left running, whatever a block does. The step is
held still on an event where order matters (no sleeps, no timing)."""

from __future__ import annotations

import threading

from llmkv_fs.engine.outcomes import Outcome
from llmkv_fs.engine.scheduling.scheduler import BlockScheduler
from llmkv_fs.engine.threads.thread_executor import ThreadExecutor

BOUND_S = 60.0  # bounds a hang only


class RecordingStep:
    """Stands in for BlockStep.run_slice: records each slice and, while
    ``hold`` is set, keeps the first slice inside until it is released."""

    def __init__(self, hold: bool = False):
        self.runs: list[tuple[bool, tuple[bytes, ...]]] = []
        self.inside = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def run_slice(self, is_load, keys, chunks, cancelled, deadline=None):
        self.runs.append((is_load, tuple(keys)))
        self.inside.set()
        assert self.release.wait(BOUND_S)
        return [Outcome.VERIFIED if is_load else Outcome.WRITTEN] * len(keys)


def job(job_id: int, is_load: bool, n: int) -> tuple:
    """What ``BlockScheduler.submit`` takes for a job of ``n`` blocks."""
    return job_id, is_load, [bytes([job_id, i]) * 18 for i in range(n)], list(range(n))


def started(step: RecordingStep, reads: int, writes: int) -> tuple[BlockScheduler, ThreadExecutor]:
    sched = BlockScheduler(max_queued_store_blocks=1000)
    executor = ThreadExecutor(step, reads, writes, name="test_io")
    sched.start(executor)
    return sched, executor


def test_every_block_runs_once_and_every_thread_ends_at_shutdown():
    step = RecordingStep()
    sched, _ = started(step, reads=2, writes=2)
    jobs = [sched.submit(*job(i, i % 2 == 0, 5)) for i in range(1, 9)]
    sched.drain()
    finished = sched.take_finished()
    assert sorted(j.job_id for j in finished) == [j.job_id for j in jobs]
    ran = [key for _, keys in step.runs for key in keys]
    assert sorted(ran) == sorted(key for j in jobs for key in j.keys)
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("test_io_"))
    assert names == ["test_io_r0", "test_io_r1", "test_io_w0", "test_io_w1"]
    sched.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("test_io_")]


def test_a_read_priority_thread_takes_a_later_load_before_an_earlier_store():
    step = RecordingStep(hold=True)
    sched, _ = started(step, reads=1, writes=0)
    sched.submit(*job(1, False, 1))  # the thread's first slice, held inside
    assert step.inside.wait(BOUND_S)
    sched.submit(*job(2, False, 1))
    sched.submit(*job(3, True, 1))
    step.release.set()
    sched.drain()
    assert [is_load for is_load, _ in step.runs] == [False, True, False]
    sched.shutdown()


def test_a_write_priority_thread_takes_a_later_store_before_an_earlier_load():
    step = RecordingStep(hold=True)
    sched, _ = started(step, reads=0, writes=1)
    sched.submit(*job(1, True, 1))
    assert step.inside.wait(BOUND_S)
    sched.submit(*job(2, True, 1))
    sched.submit(*job(3, False, 1))
    step.release.set()
    sched.drain()
    assert [is_load for is_load, _ in step.runs] == [True, False, True]
    sched.shutdown()


def test_an_idle_thread_wakes_for_work_that_arrives_later():
    """The lost wake-up the module doc rules out: threads asleep on the
    condition must see blocks queued after they went to sleep."""
    step = RecordingStep()
    sched, executor = started(step, reads=1, writes=1)
    assert executor.capacity() == 2
    for round_ in range(50):
        sched.submit(*job(round_ % 200 + 1, round_ % 2 == 0, 1))
        sched.drain()
    assert len(sched.take_finished()) == 50
    sched.shutdown()
