"""A load job delivers only the blocks before its first failure, in key
order, as vLLM's built-in fs tier does (its batch load stops at the first
bad block and reports the ones before it as ``successful_keys``): blocks no
thread has started are not read, blocks read anyway on another thread are
not delivered and not counted as read bytes.
"""

import os

import pytest
from vllm.v1.kv_offload.base import LookupResult

from llmkv_fs.engine import Direction, Failure, Outcome, Tally
from llmkv_fs.layout.blockfile import Corruption
from tests.kits.engine_kit import (
    BS,
    held_by_executor,
    pattern,
    row,
    store_blocks,
    wait_jobs,
    wait_until,
)
from tests.kits.engine_kit import make_key as engine_key
from tests.kits.matrix_kit import lookup_until, served
from tests.kits.tier_kit import (
    Replica,
    builtin,
    make_keys,
    offloading_config,
    ours,
    payload_for,
    read_primary,
)
from tests.kits.volume_kit import flip_a_bit

HIT, MISS, HIT_PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING

# The tests through vLLM's stack run our tier in both io modes too.
pytestmark = pytest.mark.usefixtures("io_mode")


def test_engine_stops_a_load_job_at_its_first_bad_block(disk_root, engines, gate_for):
    # Four places in both modes: four I/O threads, or two workers holding two
    # blocks each (one at the gate, one next in its pipe). Blocks 0-3 are held
    # out of the queue, 4 and 5 stay queued. The first block after 0 that
    # reached the gate (block b) goes bad and is let go first: it fails while
    # the other blocks out wait, so 4 and 5 are never read and the blocks
    # out after b are read but not delivered.
    places = {"io_workers": 2} if engines.mode.workers else {}
    engine, layout, primary = engines(
        disk_root, n_blocks=16, n_read_threads=2, n_write_threads=2, **places
    )
    ids = list(range(6))
    store_blocks(engine, primary, 1, ids, ids)
    keys = [engine_key(i) for i in ids]
    primary[:] = bytes(len(primary))

    gate = gate_for(engine)
    for key in keys[:4]:
        gate.hold(key)
    gate.open()
    assert engine.submit_load(2, keys, [10, 11, 12, 13, 14, 15])
    held_by_executor(engine, 4)  # blocks 0-3 out, 4 and 5 queued
    assert engine.gauges()["queued_load_blocks"] == 2
    # Threads: 0-3 at the gate; workers: the head of each worker's pipe.
    gate.wait_entered(2 if engines.mode.workers else 4)
    entered = {k for _place, _kind, k in gate.entries}
    b = min(i for i in range(1, 4) if keys[i] in entered)
    flip_a_bit(layout.block_path(keys[b]))
    gate.release(keys[b])
    # The failure took blocks 4 and 5 off the queue, unread.
    wait_until(lambda: engine.gauges()["queued_load_blocks"] == 0, "the rest to be skipped")
    for key in keys[:4]:
        if key != keys[b]:
            gate.release(key)
    job = wait_jobs(engine, [2])[2]

    loaded = [k for _thread, kind, k in gate.entries if kind == "load"]
    assert sorted(loaded) == sorted(keys[:4])  # 4 and 5 never read
    assert job.succeeded == keys[:b] and job.failed == keys[b:]
    assert job.nbytes == b * BS and not job.success
    for i in range(b):
        assert row(primary, 10 + i) == pattern(i)
    c = engine.counters
    assert c[Outcome.VERIFIED] == b  # blocks b+1..3 were read and verified, but not delivered
    assert c[Tally.BYTES_READ] == b * BS
    assert c[Direction.LOAD, Failure.CORRUPT] == 1 and c[Corruption.BAD_CHECKSUM] == 1
    assert c[Direction.LOAD, Failure.SKIPPED] == 5 - b  # b+1..3 (read, discarded), 4 and 5
    assert job.quarantined == [keys[b]]
    assert not os.path.lexists(layout.block_path(keys[b]))
    for key in keys:
        if key != keys[b]:
            assert os.path.exists(layout.block_path(key))  # skipped blocks are not bad


def test_a_later_failure_in_the_job_keeps_its_own_reason(disk_root, engines):
    # One thread: blocks run in key order; the failure stops the job at once.
    engine, _layout, primary = engines(disk_root, n_blocks=8, n_read_threads=1, n_write_threads=1)
    store_blocks(engine, primary, 1, [0, 2], [0, 2])
    keys = [engine_key(i) for i in range(4)]  # 1 and 3 were never stored
    assert engine.submit_load(2, keys, [4, 5, 6, 7])
    job = wait_jobs(engine, [2])[2]
    assert job.succeeded == keys[:1] and job.failed == keys[1:]
    c = engine.counters
    assert c[Direction.LOAD, Failure.MISSING] + c[Direction.LOAD, Failure.SKIPPED] == 3
    assert c[Direction.LOAD, Failure.MISSING] >= 1
    assert c[Tally.BYTES_READ] == BS


def _start(replicas, tier):
    replica = Replica(offloading_config(tiers=[tier]))
    replicas.append(replica)
    return replica


@pytest.mark.parametrize("tier", ["builtin", "ours"])
def test_a_block_gone_mid_job_keeps_only_the_prefix_like_vllms_builtin(
    disk_root, replicas, tier, io_mode
):
    """The same request through vLLM's TieringOffloadingManager, with vLLM's
    own fs tier and with ours: one file of four vanishes between the lookup
    and the load. Both keep exactly the block before it."""
    if tier == "builtin" and io_mode.workers:
        pytest.skip("vLLM's built-in tier has no io modes: its threads variant covers it")
    make = builtin if tier == "builtin" else ours
    writer = _start(replicas, make(disk_root))
    keys = make_keys(4, seed=f"prefix-{tier}")
    writer.store(keys)
    reader = _start(replicas, make(disk_root))
    ctx = reader.new_request()
    assert set(lookup_until(reader, keys, ctx).values()) == {HIT_PENDING}
    tier_obj = writer.tier
    gone = (
        tier_obj.file_mapper.get_file_name(keys[1])
        if tier == "builtin"
        else tier_obj.engine.roots[0].layout.block_path(keys[1])
    )
    os.unlink(gone)

    final, _ = reader.find(keys, ctx)
    assert final == {keys[0]: HIT, keys[1]: MISS, keys[2]: MISS, keys[3]: MISS}
    assert served(reader, keys, final, ctx) == (1, 0)
    if tier == "ours":
        c = reader.tier.engine.counters
        assert c[Direction.LOAD, Failure.MISSING] == 1
        assert c[Direction.LOAD, Failure.SKIPPED] == 2
        assert c[Outcome.VERIFIED] == 1
        assert c[Tally.BYTES_READ] == reader.row_bytes


def test_bit_flip_mid_job_through_vllm_keeps_the_prefix(disk_root, replicas):
    writer = _start(replicas, ours(disk_root))
    keys = make_keys(4, seed="prefix-flip")
    writer.store(keys)
    flip_a_bit(writer.tier.engine.roots[0].layout.block_path(keys[1]))
    reader = _start(replicas, ours(disk_root))
    ctx = reader.new_request()
    final, _ = reader.find(keys, ctx)
    assert final == {keys[0]: HIT, keys[1]: MISS, keys[2]: MISS, keys[3]: MISS}
    assert read_primary(reader, keys[0], ctx) == payload_for(keys[0], reader.row_bytes)
    c = reader.tier.engine.counters
    assert c[Corruption.BAD_CHECKSUM] == 1
    assert c[Direction.LOAD, Failure.SKIPPED] == 2
    assert c[Tally.BYTES_READ] == reader.row_bytes
    # The skipped blocks are fine: once that request is gone (its verdicts
    # go with it), a fresh one finds and loads them.
    reader.finish_request(ctx)
    final, _ = reader.find(keys[2:])
    assert final == {keys[2]: HIT, keys[3]: HIT}
