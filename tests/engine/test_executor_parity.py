"""Behaviour that once differed between I/O threads and worker processes,
now one code path (the scheduler and block/blockio.py), checked in both modes
(the io_mode fixture). No vLLM; real files, real processes, real tmpfs."""

from __future__ import annotations

import glob
import os
import threading

from llmkv_fs.engine import Direction, Failure, Outcome
from llmkv_fs.engine.upkeep import space as space_module
from tests.kits.engine_kit import (
    fill,
    held_by_executor,
    inside,
    make_key,
    pattern,
    wait_jobs,
    wait_until,
)


def test_a_failed_volume_stops_queued_stores_without_io(disk_root, engines, gate_for):
    """Reproduced with io_workers: 2 before the fix: the root renamed away and
    a directory with the same fan-out put in its place, the volume reported
    failed -- and every queued block was written into the new directory."""
    engine, layout, primary = engines(disk_root, n_blocks=32)
    for c in range(32):
        fill(primary, c, pattern(c))
    assert engine.submit_store(1, [make_key("warm")], [0])
    assert not wait_jobs(engine, [1])[1].failed
    gate = gate_for(engine)
    n = inside(engine).executor.capacity() + 160
    keys = [make_key(("queued", i)) for i in range(n)]
    for start in range(0, n, 8):
        assert engine.submit_store(
            100 + start, keys[start : start + 8], [c % 32 for c in range(start, start + 8)]
        )
    held_by_executor(engine, inside(engine).executor.capacity())
    # The volume goes; a directory holding the same layout takes its place.
    os.rename(disk_root, disk_root + ".gone")
    os.makedirs(os.path.dirname(layout.block_path(keys[0])))
    wait_until(
        inside(engine).recheck_volume_failed, "the housekeeping thread to see the root replaced"
    )
    gate.open()
    done = wait_jobs(engine, [100 + s for s in range(0, n, 8)])
    assert sum(len(job.failed) for job in done.values()) == n
    assert engine.counters[Direction.STORE, Failure.ROOT_LOST] == n
    assert engine.counters[Outcome.WRITTEN] == 1  # the warm-up block only
    assert not glob.glob(f"{disk_root}/**/*.bin", recursive=True)
    assert not glob.glob(f"{disk_root}/**/.*.tmp", recursive=True)


def test_enospc_trips_the_guard_where_the_write_failed(mount_tmpfs, engines, monkeypatch):
    """The baseline free space is measured by whoever saw ENOSPC (an I/O
    thread, or the worker process itself), never by the worker executor's
    conductor thread -- which once ran statvfs while holding the pool lock."""
    volume = mount_tmpfs("4m")
    engine, _layout, primary = engines(volume, n_blocks=16, block_size=256 * 1024)
    measured_on: list[str] = []
    real_usage = space_module.volume_usage

    def usage(path):
        measured_on.append(threading.current_thread().name)
        return real_usage(path)

    monkeypatch.setattr(space_module, "volume_usage", usage)
    for c in range(16):
        fill(primary, c, pattern(c, 256 * 1024), 256 * 1024)
    engine.submit_store(1, [make_key(("big", c)) for c in range(16)], list(range(16)))
    job = wait_jobs(engine, [1])[1]
    assert job.failed  # 16 x 256 KiB + trailers do not fit 4 MiB
    assert engine.counters[Direction.STORE, Failure.ERROR] + engine.counters[
        Direction.STORE, Failure.SPACE
    ] == len(job.failed)
    assert not engine.roots[0].guard.allows_store() and engine.roots[0].guard.reason == "ENOSPC"
    assert engine.roots[0].signals.free_at_enospc() is not None  # measured right then
    assert not [name for name in measured_on if name.endswith("_conductor")], measured_on
