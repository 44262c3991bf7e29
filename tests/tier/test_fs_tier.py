"""The tier inside vLLM 0.33's real TieringOffloadingManager, on real files.

Tests where a second replica (or another process) finds what the first stored
take ``shared_volume``: replica A uses ``shared_volume.a`` and replica B
``shared_volume.b`` -- the same directory, seen on GlusterFS through a second,
independent FUSE client, as a replica on another node would see it.
"""

import glob
import os

import pytest
from vllm.v1.kv_offload.base import LookupResult

from llmkv_fs import FsTier
from llmkv_fs.engine import Direction, Failure, Outcome, Tally
from llmkv_fs.layout.blockfile import Corruption
from tests.kits.engine_kit import inside
from tests.kits.nfs_kit import in_guest
from tests.kits.tier_kit import (
    Replica,
    builtin,
    make_keys,
    offloading_config,
    ours,
    payload_for,
    read_primary,
    start,
    store_burst_while_stalled,
    wait_until,
)
from tests.kits.volume_kit import block_files

HIT, MISS, RETRY, HIT_PENDING = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.RETRY,
    LookupResult.HIT_PENDING,
)

# Our tier through vLLM's stack, in both io modes (I/O threads, worker processes).
pytestmark = pytest.mark.usefixtures("io_mode")


def assert_all_promoted_byte_exact(replica, keys):
    """Look keys up until resolved; all must HIT and read back exactly."""
    ctx = replica.new_request()
    final, history = replica.find(keys, ctx)
    assert final == dict.fromkeys(keys, HIT)
    for key in keys:
        assert read_primary(replica, key, ctx) == payload_for(key, replica.row_bytes)
    return history


def test_second_manager_finds_and_promotes_byte_exact(shared_volume, replicas):
    a = start(replicas, ours(shared_volume.a))
    assert isinstance(a.tier, FsTier)
    keys = make_keys(6)
    a.store(keys)
    assert len(block_files(shared_volume.a)) == 6

    b = start(replicas, ours(shared_volume.b))  # another engine id, same root
    history = assert_all_promoted_byte_exact(b, keys)
    assert history[0] == [RETRY] * 6  # the check runs off-thread first
    assert HIT_PENDING in {r for step in history for r in step}
    assert b.tier.engine.counters[Outcome.VERIFIED] == 6


def test_unknown_keys_are_a_miss_not_a_retry_forever(volume, replicas):
    b = start(replicas, ours(volume))
    keys = make_keys(3, seed="never-stored")
    ctx = b.new_request()
    final, _ = b.find(keys, ctx)
    assert final == dict.fromkeys(keys, MISS)
    b.step()
    with b.manager.lock:  # the verdict sticks: no new probe, no RETRY
        assert [b.manager.lookup(k, ctx) for k in keys] == [MISS] * 3


def test_builtin_written_root_is_read_by_ours(shared_volume, replicas):
    writer = start(replicas, builtin(shared_volume.a))
    keys = make_keys(4, seed="vllm")
    writer.store(keys)
    files = block_files(shared_volume.a)
    assert [os.path.getsize(f) for f in files] == [writer.row_bytes] * 4  # vLLM: no trailer

    # Opt-in: trailer-less files carry no key or checksum.
    reader = start(replicas, ours(shared_volume.b, accept_trailerless=True))
    assert_all_promoted_byte_exact(reader, keys)
    assert reader.tier.engine.counters[Outcome.UNVERIFIED] == 4


def test_ours_is_read_by_builtin(shared_volume, replicas):
    writer = start(replicas, ours(shared_volume.a))
    keys = make_keys(4, seed="ours")
    writer.store(keys)
    assert {os.path.getsize(f) for f in block_files(shared_volume.a)} == {writer.row_bytes + 4096}

    reader = start(replicas, builtin(shared_volume.b))
    assert_all_promoted_byte_exact(reader, keys)


def test_bit_flip_is_never_loaded_and_is_quarantined(shared_volume, replicas):
    a = start(replicas, ours(shared_volume.a))
    keys = make_keys(3, seed="flip")
    a.store(keys)
    bad = a.tier.engine.roots[0].layout.block_path(keys[1])
    with open(bad, "r+b") as f:  # same size, one bit flipped in the payload
        f.seek(12345)
        byte = f.read(1)[0]
        f.seek(12345)
        f.write(bytes([byte ^ 0x10]))

    b = start(replicas, ours(shared_volume.b))
    ctx = b.new_request()
    final, _ = b.find(keys, ctx)
    # The corrupt block became a MISS (promotion failed, verdict forced);
    # the block before it was kept (partial success) and is byte exact, the
    # one after it is not delivered (vLLM uses only the prefix).
    assert final == {keys[0]: HIT, keys[1]: MISS, keys[2]: MISS}
    assert read_primary(b, keys[0], ctx) == payload_for(keys[0], b.row_bytes)
    with b.manager.lock:
        assert b.manager.primary_tier.lookup(keys[1], ctx) is MISS
    assert not os.path.lexists(
        b.tier.engine.roots[0].layout.block_path(keys[1])
    )  # B moved it: B's view
    # A's client may keep answering from its entry/attribute cache (GlusterFS
    # FUSE: 1 s by default) after B renamed the file away, so A's view is
    # polled -- it must converge, well within the deadline.
    wait_until(lambda: not os.path.lexists(bad), "replica A to see the bad file gone")
    (moved,) = glob.glob(f"{b.tier.engine.roots[0].layout.quarantine_dir}/*")
    assert ".bad-checksum." in moved
    assert b.tier.engine.counters[Corruption.BAD_CHECKSUM] == 1

    # A fresh request does not find it again (no livelock, no re-load).
    final, _ = b.find([keys[1]])
    assert final == {keys[1]: MISS}
    assert b.tier.engine.counters[Corruption.BAD_CHECKSUM] == 1


def test_truncated_and_wrong_key_files_are_rejected(shared_volume, replicas):
    a = start(replicas, ours(shared_volume.a))
    keys = make_keys(3, seed="damage")
    a.store(keys)
    layout = a.tier.engine.roots[0].layout
    os.truncate(layout.block_path(keys[0]), a.row_bytes // 2)
    # keys[1]'s file replaced by keys[2]'s (a valid file under the wrong name)
    os.replace(layout.block_path(keys[2]), layout.block_path(keys[1]))

    b = start(replicas, ours(shared_volume.b))
    final, _ = b.find(keys[:2])
    # The truncated file has a size no reader accepts: the lookup says MISS.
    assert final[keys[0]] is MISS
    assert final[keys[1]] is MISS
    assert b.tier.engine.counters[Corruption.WRONG_KEY] == 1


def test_store_skips_blocks_already_present(shared_volume, replicas):
    a = start(replicas, ours(shared_volume.a))
    keys = make_keys(3, seed="dup")
    a.store(keys)
    identity = [(os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in block_files(shared_volume.a)]
    b = start(replicas, ours(shared_volume.b))
    b.store(keys)
    # Checked through B's client: A's client could still answer a rewrite
    # with attributes it cached before B's store.
    assert [
        (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in block_files(shared_volume.b)
    ] == identity
    assert b.tier.engine.counters[Outcome.PRESENT] == 3


def test_reset_cache_with_jobs_in_flight(disk_root, replicas):
    a = start(replicas, ours(disk_root), cpu_bytes=128 << 20)
    keys = make_keys(24, seed="reset")
    a.store(keys, settle=False)  # 24 stores queued on 4 threads
    with a.manager.lock:
        a.manager.reset_cache()  # drains the tier before freeing primary rows
        assert not a.manager.has_pending_work()
    assert len(block_files(disk_root)) == 24
    assert not glob.glob(f"{disk_root}/**/.*.tmp", recursive=True)
    a.manager.on_reset_flushed()
    final, _ = a.find(keys)  # primary was reset: found again through our tier
    assert set(final.values()) == {HIT}


def test_shutdown_with_jobs_queued_leaves_no_partial_files(disk_root, replicas):
    a = Replica(
        offloading_config(
            tiers=[ours(disk_root, n_read_threads=1, n_write_threads=1)], cpu_bytes=128 << 20
        )
    )
    keys = make_keys(40, seed="shutdown")
    a.store(keys, settle=False)
    # Shut down mid-stream: once the first block is published, the rest are
    # running or queued (2 threads, 40 blocks).
    wait_until(lambda: block_files(disk_root), "the first block to be published")
    a.close()  # cancels queued blocks, finishes running ones
    files = block_files(disk_root)
    assert 1 <= len(files) <= 40
    for path in files:
        assert os.path.getsize(path) == a.spec.kv_bytes_per_chunk + 4096
    assert not glob.glob(f"{disk_root}/**/.*.tmp", recursive=True)


def test_write_queue_bound_fails_stores_instead_of_growing(disk_root, replicas):
    a = start(
        replicas,
        ours(disk_root, n_read_threads=1, n_write_threads=1, max_pending_store_blocks=4),
        cpu_bytes=128 << 20,
    )
    # Hold the volume "slow" until the burst is submitted: the executor takes
    # what it can hold (two I/O threads one block each, or two workers two
    # each) and the queue holds at most 4 more.
    keys = make_keys(30, seed="burst")
    store_burst_while_stalled(a, keys)
    dropped = a.tier.engine.counters[Direction.STORE, Failure.QUEUE_FULL]
    assert dropped >= 30 - inside(a.tier.engine).executor.capacity() - 4
    assert len(block_files(disk_root)) == 30 - dropped
    # Dropped blocks are still in the CPU tier: nothing is lost for serving.
    final, _ = a.find(keys)
    assert set(final.values()) == {HIT}


def test_shutdown_after_a_failed_load_releases_the_primary_mapping(shared_volume, replicas):
    a = start(replicas, ours(shared_volume.a))
    keys = make_keys(2, seed="release")
    a.store(keys)
    os.truncate(a.tier.engine.roots[0].layout.block_path(keys[0]), 10)  # lookup says MISS
    with open(a.tier.engine.roots[0].layout.block_path(keys[1]), "r+b") as f:
        f.write(b"\xff" * 64)  # same size, bad checksum: the load fails
    b = Replica(offloading_config(tiers=[ours(shared_volume.b)]))
    b.find(keys)
    assert b.tier.engine.counters[Tally.QUARANTINED] == 1
    region = b.manager.primary_tier._mmap_region
    b.close()
    # vLLM keeps the mapping (and warns) if any view of it is still exported.
    assert region.mmap_obj is None


def test_trailerless_files_are_refused_when_configured(shared_volume, replicas):
    writer = start(replicas, builtin(shared_volume.a))
    keys = make_keys(2, seed="strict")
    writer.store(keys)
    strict = start(replicas, ours(shared_volume.b, accept_trailerless=False))
    final, _ = strict.find(keys)
    assert final == dict.fromkeys(keys, MISS)  # lookup already rejects the size
    assert strict.tier.engine.counters[Outcome.UNVERIFIED] == 0


STORE_IN_ANOTHER_PROCESS = r"""
import sys
from llmkv_fs.harness.driver import Replica, make_keys, offloading_config, ours
tier = ours(sys.argv[1], n_read_threads=1, n_write_threads=2, io_workers=int(sys.argv[2]))
replica = Replica(offloading_config(tiers=[tier]))
assert replica.tier.engine.io_workers == int(sys.argv[2])
replica.store(make_keys(5, seed="cross-process"))
replica.close()
"""


@pytest.mark.integration  # each replica a fresh interpreter importing vLLM (~20 s each)
def test_blocks_stored_by_another_process_are_found_byte_exact(shared_volume, replicas, io_mode):
    import subprocess
    import sys

    io_workers = "3" if io_mode.workers else "0"  # the child's tier, in the test's io mode
    done = subprocess.run(
        [sys.executable, "-c", STORE_IN_ANOTHER_PROCESS, shared_volume.a, io_workers],
        capture_output=True,
        text=True,
        # The child imports vLLM: ~10 s here, 354 s in the emulated NFS guest.
        timeout=900 if in_guest() else 300,
    )
    assert done.returncode == 0, done.stderr
    reader = start(replicas, ours(shared_volume.b))
    assert_all_promoted_byte_exact(reader, make_keys(5, seed="cross-process"))
    assert reader.tier.engine.counters[Outcome.VERIFIED] == 5
