"""Fault matrix, a volume that stops answering and a volume that cannot keep
up: the GlusterFS brick process SIGSTOPped under a replica with loads and
stores in flight, and a write burst far larger than the store queue.

The scheduler side (every FsTier call vLLM's manager makes) must stay fast
in both: TierClock times each call.
"""

import time

import numpy as np
import pytest

from llmkv_fs.engine import Direction, Failure, Outcome

from gluster_kit import _gluster
from matrix_kit import (
    HIT,
    HIT_PENDING,
    MISS,
    TierClock,
    brick_pid,
    gluster_dirs,
    lookup_until,
    record,
    served,
    stopped,
)
from tier_kit import MiB, Replica, assert_io_mode, make_keys, offloading_config, ours, payload_for
from volume_kit import block_files, temp_files

# Our tier in both io modes (I/O threads, worker processes).
pytestmark = pytest.mark.usefixtures("io_mode")

JOB_TIMEOUT_S = 2.0
CALL_BOUND_S = 0.2  # the slowest single tier call allowed while the volume is stalled
STALL_S = JOB_TIMEOUT_S + 1.5


def _multiplexed() -> bool:
    """With brick multiplexing one glusterfsd serves every volume on the
    machine: stopping it would stall other sessions' volumes too."""
    done = _gluster("volume", "get", "all", "cluster.brick-multiplex")
    return done.returncode == 0 and any(w in done.stdout.lower().split() for w in ("on", "enable"))


def test_stalled_brick_never_blocks_the_scheduler(gluster, replicas):
    if _multiplexed():
        pytest.skip("brick multiplexing is on: SIGSTOP would stall other volumes")
    root_a, root_b = gluster_dirs(gluster, "stall")
    writer = Replica(offloading_config(tiers=[ours(root_a)]))
    replicas.append(writer)
    loads = make_keys(4, seed="stall-load")
    writer.store(loads)
    reader = Replica(offloading_config(tiers=[ours(root_b, job_timeout_s=JOB_TIMEOUT_S)]))
    replicas.append(reader)
    assert_io_mode(reader)
    clock = TierClock(reader.tier)
    engine, counters = reader.tier.engine, reader.tier.engine.counters

    ctx = reader.new_request()
    assert set(lookup_until(reader, loads, ctx).values()) == {HIT_PENDING}  # loads are next
    stores, refused = make_keys(4, seed="stall-store"), make_keys(2, seed="stall-refused")
    fresh = make_keys(3, seed="stall-fresh")
    seen = {"store_failed_at": None, "stalled_at": None, "fresh_miss_at": None}
    slowest_step = 0.0

    with stopped(brick_pid(gluster)):
        start = time.monotonic()
        clock.slowest.clear()
        reader.store(stores, settle=False)
        reader.step()  # submits the promotion (loads) and the cascade (stores)
        loads_submitted = clock.calls["submit_load"]
        fresh_ctx = reader.new_request()
        while time.monotonic() - start < STALL_S:  # the scheduler keeps stepping
            began = time.perf_counter()
            reader.step()
            with reader.manager.lock:
                verdicts = [reader.manager.lookup(k, fresh_ctx) for k in fresh]
                pending = [reader.manager.lookup(k, ctx) for k in loads]
            slowest_step = max(slowest_step, time.perf_counter() - began)
            now = time.monotonic() - start
            if seen["store_failed_at"] is None and counters[Direction.STORE, Failure.DEADLINE]:
                seen["store_failed_at"] = now
            if seen["stalled_at"] is None and engine.stalled():
                seen["stalled_at"] = now
            if seen["fresh_miss_at"] is None and set(verdicts) == {MISS}:
                seen["fresh_miss_at"] = now
            time.sleep(0.01)

        # Still stalled. Stores failed at their deadline, all of them.
        assert counters[Direction.STORE, Failure.DEADLINE] == len(stores), dict(counters)
        assert JOB_TIMEOUT_S - 0.1 <= seen["store_failed_at"] <= JOB_TIMEOUT_S + 1.0, seen
        assert engine.stalled() and engine.gauges()["stuck_blocks"] >= 1
        # Lookups answer MISS; nothing new is promoted, so no load is submitted.
        assert verdicts == [MISS] * len(fresh) and seen["fresh_miss_at"] is not None
        assert clock.calls["submit_load"] == loads_submitted
        # The load job is not reported while its reads sit in the kernel: the
        # rows stay pending (vLLM cannot hand them out or reuse them).
        assert pending == [HIT_PENDING] * len(loads)
        # New stores are refused at once.
        reader.store(refused, settle=False)
        reader.step()
        assert counters[Direction.STORE, Failure.STALLED] == len(refused)
        stall_tier_max = clock.max_s
        assert clock.errors == []
        assert stall_tier_max < CALL_BOUND_S, dict(clock.slowest)

    # SIGCONT: the reads return, the load job is reported, the stall clears.
    resumed = time.monotonic()
    reader.settle()
    deadline = time.monotonic() + 30
    while engine.stalled():
        assert time.monotonic() < deadline, "still stalled 30 s after SIGCONT"
        reader.step()
        time.sleep(0.01)
    recovered_s = time.monotonic() - resumed
    final, _ = reader.find(loads, ctx)
    hits, wrong = served(reader, loads, final, ctx)
    assert wrong == 0
    assert set(final.values()) <= {HIT, MISS}
    assert (
        temp_files(reader.tier.engine.roots[0].layout.rank_dir) == []
    )  # abandoned stores cleaned up
    assert block_files(reader.tier.engine.roots[0].layout.rank_dir) == sorted(
        reader.tier.engine.roots[0].layout.block_path(k) for k in loads
    )  # nothing published past its deadline

    # A full round trip works again: B stores, A (the other client) loads.
    after = make_keys(3, seed="stall-after")
    reader.store(after)
    assert counters[Outcome.WRITTEN] == len(after)
    wctx = writer.new_request()
    wfinal, _ = writer.find(after, wctx)
    assert wfinal == dict.fromkeys(after, HIT)
    assert served(writer, after, wfinal, wctx) == (len(after), 0)
    assert clock.errors == []
    record(
        "stalled_brick",
        stall_s=STALL_S,
        job_timeout_s=JOB_TIMEOUT_S,
        tier_calls=sum(clock.calls.values()),
        slowest_tier_call_s=round(stall_tier_max, 4),
        slowest_step_s=round(slowest_step, 4),
        store_failed_at_s=round(seen["store_failed_at"], 3),
        stalled_at_s=round(seen["stalled_at"], 3),
        fresh_miss_at_s=round(seen["fresh_miss_at"], 3),
        stores_failed=counters[Direction.STORE, Failure.DEADLINE],
        stores_refused=counters[Direction.STORE, Failure.STALLED],
        loads_served_after=hits,
        wrong=wrong,
        recovered_s=round(recovered_s, 3),
        scheduler_exceptions=len(clock.errors),
    )


# -- a write burst larger than the queue ------------------------------------------------

QUEUE_BOUND = 8


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _burst_store(replica, batches) -> None:
    """Many requests' KV lands in the CPU tier, then the scheduler completes
    their stores back to back (complete_store submits each to the tier at
    once): what one busy step looks like."""
    pending = []
    for batch in batches:
        ctx = replica.new_request()
        with replica.manager.lock:
            out = replica.manager.prepare_store(list(batch), ctx)
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            replica.rows[chunk, :] = np.frombuffer(payload_for(key, replica.row_bytes), np.int8)
        pending.append((batch, ctx))
    for batch, ctx in pending:
        with replica.manager.lock:
            replica.manager.complete_store(list(batch), ctx)
        replica.finish_request(ctx)


def test_write_burst_drops_stores_and_loads_stay_fast(volume, replicas, request):
    seeder = Replica(offloading_config(tiers=[ours(volume)]))
    replicas.append(seeder)
    load_keys = make_keys(24, seed="burst-load")
    seeder.store(load_keys)
    replica = Replica(
        offloading_config(
            tiers=[ours(volume, max_pending_store_blocks=QUEUE_BOUND)], cpu_bytes=160 * MiB
        )
    )
    replicas.append(replica)
    assert_io_mode(replica)
    clock = TierClock(replica.tier)
    engine, counters = replica.tier.engine, replica.tier.engine.counters

    deepest = 0

    def load_one(key, burst=()) -> None:
        """One single-block load. The burst's store jobs are submitted after
        the lookup said HIT and before the load is: the load meets a full
        store queue and busy threads."""
        nonlocal deepest
        ctx = replica.new_request()
        assert lookup_until(replica, [key], ctx) == {key: HIT_PENDING}
        _burst_store(replica, burst)
        deepest = max(deepest, engine.queued_store_blocks())
        final, _ = replica.find([key], ctx)  # the next step submits the load
        assert final == {key: HIT}
        assert served(replica, [key], final, ctx) == (1, 0)
        replica.finish_request(ctx)

    for key in load_keys[:12]:  # idle volume
        load_one(key)
    idle = list(engine.job_latencies[Direction.LOAD])
    engine.job_latencies[Direction.LOAD].clear()

    burst = make_keys(12 * 24, seed="burst-store")  # 12 rounds of 6 jobs x 4 blocks
    for i, key in enumerate(load_keys[12:]):
        round_keys = burst[i * 24 : (i + 1) * 24]
        load_one(key, [round_keys[j : j + 4] for j in range(0, 24, 4)])
    during = list(engine.job_latencies[Direction.LOAD])
    replica.settle()

    dropped = counters[Direction.STORE, Failure.QUEUE_FULL]
    assert dropped > 0
    assert counters[Outcome.WRITTEN] + dropped == len(burst)
    assert deepest <= QUEUE_BOUND
    assert (
        len(block_files(replica.tier.engine.roots[0].layout.rank_dir))
        == len(load_keys) + counters[Outcome.WRITTEN]
    )
    assert clock.errors == []
    idle_p99, burst_p99 = _p99(idle), _p99(during)
    # Loads go first on the read-priority threads: during the burst a load
    # waits at most for the block a thread is copying. The bound is generous
    # on purpose: this runs on shared 2-core machines.
    assert burst_p99 < max(10 * idle_p99, 0.5), (idle, during)
    record(
        "write_burst",
        fs=request.node.callspec.params["volume"],
        queue_bound=QUEUE_BOUND,
        burst_blocks=len(burst),
        dropped=dropped,
        written=counters[Outcome.WRITTEN],
        deepest_queue=deepest,
        idle_load_p99_ms=round(idle_p99 * 1e3, 1),
        burst_load_p99_ms=round(burst_p99 * 1e3, 1),
        loads=len(idle) + len(during),
        wrong=0,
        scheduler_exceptions=len(clock.errors),
    )
