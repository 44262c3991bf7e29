"""gc evicting blocks while a real tier (vLLM 0.33's TieringOffloadingManager
on CPU, through tests/kits/tier_kit.py) loads the same blocks. A load of an
evicted block fails cleanly for that key -- MISS, never wrong bytes, never an
exception -- and a fresh store of it works."""

import json
import os

import pytest
from vllm.v1.kv_offload.base import LookupResult

from tests.kits.gc_kit import age, cache_entries, gc_process, gc_run, running, stop_watch
from tests.kits.tier_kit import make_keys, ours, payload_for, read_primary, start, wait_until

HIT, MISS, RETRY, HIT_PENDING = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.RETRY,
    LookupResult.HIT_PENDING,
)
EVICT_ALL = ("--max-bytes", "0", "--protect", "0", "--high", "off")

# Our tier through vLLM's stack, in both io modes (I/O threads, worker processes).
pytestmark = pytest.mark.usefixtures("io_mode")


def lookup_all(replica, keys, ctx):
    with replica.manager.lock:
        return [replica.manager.lookup(k, ctx) for k in keys]


def promotions_started(replica, keys):
    """Look keys up until the tier said HIT and the manager started their
    promotion (HIT_PENDING); the load itself is submitted at the next step."""
    ctx = replica.new_request()
    assert lookup_all(replica, keys, ctx) == [RETRY] * len(keys)
    replica.step()  # posts the existence checks
    seen = []

    def started():
        seen[:] = lookup_all(replica, keys, ctx)
        return RETRY not in seen

    wait_until(started, "existence verdicts")
    assert seen == [HIT_PENDING] * len(keys)
    return ctx


def assert_hits_byte_exact(replica, keys):
    ctx = replica.new_request()
    final, _ = replica.find(keys, ctx)
    assert final == dict.fromkeys(keys, HIT)
    for key in keys:
        assert read_primary(replica, key, ctx) == payload_for(key, replica.row_bytes)


def test_evicted_between_lookup_and_load_is_a_clean_miss(volume, replicas):
    writer = start(replicas, ours(volume))
    keys = make_keys(6, seed="gc-evict")
    writer.store(keys)
    paths = [writer.tier.engine.roots[0].layout.block_path(k) for k in keys]
    # The later half is older: --max-bytes asks for exactly those to go. (A
    # load keeps only the prefix before its first failed block, as vLLM's
    # built-in does, so the evicted blocks are the suffix of the request.)
    for path in paths[3:]:
        age(path, 7200)
    size = os.lstat(paths[0]).st_blocks * 512
    cache = sum(os.lstat(f"{volume}/{p}").st_blocks * 512 for p in cache_entries(volume))

    reader = start(replicas, ours(volume))
    ctx = promotions_started(reader, keys)
    done = gc_run(
        volume, "--json", "--max-bytes", str(cache - 3 * size), "--protect", "1h", "--high", "off"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["capacity"]["evicted_blocks"] == 3
    assert [os.path.exists(p) for p in paths] == [True] * 3 + [False] * 3

    final, _ = reader.find(keys, ctx)  # submits the load, steps until resolved
    assert final == {**dict.fromkeys(keys[:3], HIT), **dict.fromkeys(keys[3:], MISS)}
    for key in keys[:3]:
        assert read_primary(reader, key, ctx) == payload_for(key, reader.row_bytes)
    # The MISS sticks (no livelock on a doomed load) ...
    again, _ = reader.find(keys[3:])
    assert again == dict.fromkeys(keys[3:], MISS)
    # ... and a fresh store of the evicted blocks works and is found by others.
    reader.store(keys[3:])
    assert all(os.path.exists(p) for p in paths)
    assert_hits_byte_exact(start(replicas, ours(volume)), keys)


def test_everything_evicted_after_lookup(disk_root, replicas):
    writer = start(replicas, ours(disk_root))
    keys = make_keys(4, seed="gc-all")
    writer.store(keys)
    reader = start(replicas, ours(disk_root))
    ctx = promotions_started(reader, keys)
    assert gc_run(disk_root, *EVICT_ALL).returncode == 0
    final, _ = reader.find(keys, ctx)
    assert final == dict.fromkeys(keys, MISS)
    writer.close()
    replicas.remove(writer)
    reader.store(keys)
    assert_hits_byte_exact(start(replicas, ours(disk_root)), keys)


def test_loads_race_a_gc_that_evicts_continuously(volume, replicas):
    """A --watch gc evicts everything it sees while a replica stores and a
    second one looks up and loads: every HIT is byte exact, the rest MISS."""
    writer = start(replicas, ours(volume))
    reader = start(replicas, ours(volume))
    outcomes = {HIT: 0, MISS: 0}
    with running(gc_process(volume, *EVICT_ALL, "--watch", "0", "--json")) as watcher:
        first = watcher.stdout.readline()  # its first pass is done: it is running
        assert first, watcher.stderr.read()
        for round_ in range(8):
            keys = make_keys(4, seed=f"race-{round_}")
            writer.store(keys)
            ctx = reader.new_request()
            final, _ = reader.find(keys, ctx)
            for key, verdict in final.items():
                assert verdict in (HIT, MISS)
                outcomes[verdict] += 1
                if verdict is HIT:
                    assert read_primary(reader, key, ctx) == payload_for(key, reader.row_bytes)
            reader.finish_request(ctx)
        passes = [json.loads(first), *stop_watch(watcher)]
    assert sum(p["capacity"]["evicted_blocks"] for p in passes) > 0
    assert all(p["error_count"] == 0 for p in passes), [p["errors"] for p in passes]
    assert outcomes[HIT] + outcomes[MISS] == 32
