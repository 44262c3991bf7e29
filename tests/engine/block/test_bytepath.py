"""The byte path is a seam (engine/block/bytepath.py): a second implementation
given to the engine moves every block, in I/O threads and in worker processes
alike, and inherits every check around it -- the checksum, the chunk index,
a lost root -- without implementing any of them (tests/kits/bytepath_kit.py)."""

from __future__ import annotations

import os

import pytest

from llmkv_fs.engine import Direction, Failure, Outcome
from llmkv_fs.layout.blockfile import TRAILER_SIZE, verify_block
from tests.kits import REPO
from tests.kits.bytepath_kit import (
    TRACE_ENV,
    FlippingBytes,
    PlainBytes,
    ShortBytes,
    UnsealedBytes,
)
from tests.kits.engine_kit import BS, fill, inside, make_key, pattern, row, wait_jobs, wait_until


@pytest.fixture
def trace(tmp_path, monkeypatch):
    """Where the byte path leaves its marks; worker processes import it from
    the repository root (``tests.kits.bytepath_kit``)."""
    path = tmp_path / "trace"
    path.mkdir()
    monkeypatch.setenv(TRACE_ENV, str(path))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    return path


def _movers(trace, op: str) -> set[int]:
    return {int(name.split(".")[1]) for name in os.listdir(trace) if name.startswith(f"{op}.")}


def test_a_second_byte_path_moves_every_block_in_both_modes(engines, volume, trace):
    engine, layout, primary = engines(volume, n_blocks=8, byte_path=PlainBytes)
    keys = [make_key(i) for i in range(8)]
    for i in range(8):
        fill(primary, i, pattern(i))
    assert engine.submit_store(1, keys, list(range(8)))
    assert wait_jobs(engine, [1])[1].success
    primary[:] = bytes(len(primary))
    assert engine.submit_load(2, keys, list(range(8)))
    assert wait_jobs(engine, [2])[2].success
    assert all(row(primary, i) == pattern(i) for i in range(8))
    # It hashed nothing, yet the engine sealed and checked every checksum.
    assert engine.counters[Outcome.WRITTEN] == 8
    assert engine.counters[Outcome.VERIFIED] == 8
    with open(layout.block_path(keys[3]), "rb") as f:
        data = f.read()
    assert len(data) == BS + TRAILER_SIZE
    assert verify_block(data[:BS], data[BS:], keys[3], verify_checksum=True).has_checksum
    # Who moved the bytes: the worker processes, or this process's threads.
    workers = set(inside(engine).executor.worker_pids())
    for op in ("write", "read"):
        if engines.mode.workers:
            assert _movers(trace, op) and _movers(trace, op) <= workers
        else:
            assert _movers(trace, op) == {os.getpid()}


def test_a_byte_path_that_hands_back_a_wrong_byte_serves_nothing(engines, volume, trace):
    engine, layout, primary = engines(volume, n_blocks=4, byte_path=FlippingBytes)
    keys = [make_key(i) for i in range(4)]
    for i in range(4):
        fill(primary, i, pattern(i))
    assert engine.submit_store(1, keys, list(range(4)))
    assert wait_jobs(engine, [1])[1].success
    assert engine.submit_load(2, keys, list(range(4)))
    job = wait_jobs(engine, [2])[2]
    assert job.succeeded == [] and job.failed == keys
    assert engine.counters[Direction.LOAD, Failure.CORRUPT] >= 1  # the first; the rest skipped
    assert engine.counters[Outcome.VERIFIED] == 0
    # The good file it misread went to quarantine: the engine's rule, not the byte path's.
    assert not os.path.exists(layout.block_path(keys[0]))


@pytest.mark.parametrize("lying", [ShortBytes, UnsealedBytes], ids=["short", "unsealed"])
def test_a_byte_path_that_lies_gets_nothing_published(engines, volume, trace, lying):
    """A byte path that returns normally after a short write, or without
    sealing the trailer: the store fails (not counted written), nothing is
    published under the block's name, no temp file is left."""
    engine, layout, primary = engines(volume, n_blocks=4, byte_path=lying)
    keys = [make_key(i) for i in range(4)]
    for i in range(4):
        fill(primary, i, pattern(i))
    assert engine.submit_store(1, keys, list(range(4)))
    job = wait_jobs(engine, [1])[1]
    assert job.succeeded == [] and job.failed == keys
    assert engine.counters[Outcome.WRITTEN] == 0
    assert engine.counters[Direction.STORE, Failure.ERROR] == len(keys)
    for key in keys:
        leaf = os.path.dirname(layout.block_path(key))
        assert not os.path.exists(layout.block_path(key))
        assert not os.path.isdir(leaf) or os.listdir(leaf) == []
    assert _movers(trace, "write")  # it did run, in this process or the workers


def test_checks_before_the_byte_path_are_the_engines(engines, volume, trace):
    """A chunk outside the buffer, and a block placed on a lost root, never
    reach the byte path; the other root's blocks do."""
    roots = [f"{volume}/r0", f"{volume}/r1"]
    engine, _, primary = engines(
        ",".join(roots), n_blocks=16, byte_path=PlainBytes, path_sharding="by_block_hash"
    )
    assert engine.submit_store(1, [make_key(99)], [16])  # one past the last row
    assert wait_jobs(engine, [1])[1].failed == [make_key(99)]
    assert _movers(trace, "write") == set()

    lost = engine.roots[1]
    os.rename(lost.root_dir, f"{volume}/moved")  # as if unmounted: another directory there
    os.mkdir(lost.root_dir)
    wait_until(lambda: engine.root_gauges()[lost.root_dir]["volume_failed"] == 1, "root 1 lost")
    keys = [make_key(i) for i in range(16)]
    for i in range(16):
        fill(primary, i, pattern(i))
    assert engine.submit_store(2, keys, list(range(16)))
    job = wait_jobs(engine, [2])[2]
    homed_on_lost = {k for k in keys if inside(engine).placement.home(k) == 1}
    assert homed_on_lost and set(job.failed) == homed_on_lost
    assert engine.counters[Direction.STORE, Failure.ROOT_LOST] == len(homed_on_lost)
    written = sum(
        os.path.getsize(trace / name) for name in os.listdir(trace) if name.startswith("write.")
    )
    assert written == len(keys) - len(homed_on_lost)
