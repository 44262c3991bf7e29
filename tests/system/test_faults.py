"""Bad volumes through the real vLLM stack: a full disk and a read-only
root. The scheduler never sees an exception and no wrong byte reaches the
CPU tier."""

import os

import pytest
from vllm.v1.kv_offload.base import LookupResult

from llmkv_fs.engine import Direction, Failure
from tests.kits.tier_kit import (
    Replica,
    make_keys,
    offloading_config,
    ours,
    payload_for,
    read_primary,
)
from tests.kits.volume_kit import block_files, temp_files

# Our tier through vLLM's stack, in both io modes (I/O threads, worker processes).
pytestmark = pytest.mark.usefixtures("io_mode")


def test_full_disk_fails_stores_cleanly_and_reads_continue(mount_tmpfs, io_mode):
    small_tmpfs = mount_tmpfs("12m")  # room for five 2 MiB blocks and their trailers
    replica = Replica(offloading_config(tiers=[ours(small_tmpfs)], cpu_bytes=64 << 20))
    try:
        assert bool(replica.tier.engine.io_workers) == io_mode.workers
        keys = make_keys(10, seed="enospc")
        replica.store(keys)  # raises nothing into the "scheduler"
        counters = replica.tier.engine.counters
        files = block_files(small_tmpfs)
        assert 0 < len(files) < 10
        # The first ENOSPC trips the space guard: later blocks are dropped
        # without touching the volume, and stay dropped until space is freed.
        errors = counters[Direction.STORE, Failure.ERROR]
        assert errors >= 1
        assert errors + counters[Direction.STORE, Failure.SPACE] == 10 - len(files)
        assert not replica.tier.engine.roots[0].guard.allows_store()
        # Nothing torn under a final name, no temp file left behind.
        assert {os.path.getsize(f) for f in files} == {replica.row_bytes + 4096}
        assert not temp_files(small_tmpfs)

        reader = Replica(offloading_config(tiers=[ours(small_tmpfs)], cpu_bytes=64 << 20))
        try:
            ctx = reader.new_request()
            final, _ = reader.find(keys, ctx)
            stored = {
                k for k in keys if os.path.exists(reader.tier.engine.roots[0].layout.block_path(k))
            }
            assert {k for k, v in final.items() if v is LookupResult.HIT} == stored
            for key in stored:
                assert read_primary(reader, key, ctx) == payload_for(key, reader.row_bytes)
        finally:
            reader.close()
    finally:
        replica.close()


def test_read_only_root_is_a_clear_startup_error(mount_tmpfs):
    mountpoint = mount_tmpfs("1m", "ro")
    with pytest.raises(Exception, match="not writable") as info:
        Replica(offloading_config(tiers=[ours(mountpoint)]))
    assert mountpoint in str(info.value)
