"""Fault matrix, a volume that stops answering and a volume that cannot keep
up: the GlusterFS brick process SIGSTOPped under a replica with loads and
stores in flight, and a write burst far larger than the store queue.

The scheduler side (every FsTier call vLLM's manager makes) must never wait
for the volume: while the brick is stopped, every call returns (TierClock
keeps the slowest for the figures). Neither test asserts on elapsed time:
deadlines pass when the test moves the engine's clock, and what must not
wait is held still at a pause point (or a stopped brick) while it is checked.
"""

import collections
import os
import threading
import time

import numpy as np
import pytest

from llmkv_fs.engine import Direction, Failure, Outcome, lookup, lookup_checks
from llmkv_fs.engine.scheduling import scheduler
from tests.kits.clock_kit import JUST_BEFORE_S, ManualClock
from tests.kits.engine_kit import Gate, held_by_executor, inside
from tests.kits.matrix_kit import (
    HIT,
    HIT_PENDING,
    MISS,
    RETRY,
    TierClock,
    brick_pid,
    gluster_dirs,
    lookup_until,
    record,
    served,
    stopped,
)
from tests.kits.tier_kit import (
    DEADLINE_S,
    MiB,
    Replica,
    assert_io_mode,
    make_keys,
    offloading_config,
    ours,
    payload_for,
    wait_until,
)
from tests.kits.volume_kit import block_files, temp_files
from tools.gluster import glusterd

# Our tier in both io modes (I/O threads, worker processes).
pytestmark = pytest.mark.usefixtures("io_mode")

JOB_TIMEOUT_S = 2.0
STEPS = 20  # scheduler steps taken at each stage of the stall


def _multiplexed() -> bool:
    """With brick multiplexing one glusterfsd serves every volume on the
    machine: stopping it would stall other sessions' volumes too."""
    done = glusterd.gluster("volume", "get", "all", "cluster.brick-multiplex")
    return done.returncode == 0 and any(w in done.stdout.lower().split() for w in ("on", "enable"))


def _returns(body):
    """``body()`` on a thread of its own (the scheduler's): it must return
    while the volume is still stopped -- a call that waited for the volume
    would wait until the test gives up here. Returns what it returned,
    raises what it raised."""
    outcome = {}

    def run():
        try:
            outcome["value"] = body()
        except BaseException as exc:  # re-raised on the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="scheduler")
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "a tier call waited for the stopped volume"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_stalled_brick_never_blocks_the_scheduler(gluster, replicas, monkeypatch):
    if _multiplexed():
        pytest.skip("brick multiplexing is on: SIGSTOP would stall other volumes")
    # The engine's job and lookup deadlines run on this clock: they pass
    # when the test moves it, however long the steps before took.
    clock = ManualClock().install(monkeypatch, scheduler, lookup, lookup_checks)
    root_a, root_b = gluster_dirs(gluster, "stall")
    writer = Replica(offloading_config(tiers=[ours(root_a)]))
    replicas.append(writer)
    # Two loads and two stores: no more blocks than the executor has places
    # (4: two workers or four threads), so every one of them is out, inside
    # the stopped volume, when the deadline passes. With four of each, the
    # places went to one direction only, now and then: stores never out
    # (nothing stuck, no stall) or loads never out (failed from the queue and
    # reported, no longer pending) -- a failure in 1 of 4 runs, before too.
    loads = make_keys(2, seed="stall-load")
    writer.store(loads)
    reader = Replica(offloading_config(tiers=[ours(root_b, job_timeout_s=JOB_TIMEOUT_S)]))
    replicas.append(reader)
    assert_io_mode(reader)
    tier_clock = TierClock(reader.tier)
    engine, counters = reader.tier.engine, reader.tier.engine.counters

    ctx = reader.new_request()
    assert set(lookup_until(reader, loads, ctx).values()) == {HIT_PENDING}  # loads are next
    stores, refused = make_keys(2, seed="stall-store"), make_keys(2, seed="stall-refused")
    fresh = make_keys(3, seed="stall-fresh")
    fresh_ctx = reader.new_request()

    def steps() -> tuple[list, list]:
        """The scheduler keeps stepping: (fresh keys' verdicts, the
        promoted keys' verdicts) after the last step."""
        for _ in range(STEPS):
            reader.step()
            with reader.manager.lock:
                verdicts = [reader.manager.lookup(k, fresh_ctx) for k in fresh]
                pending = [reader.manager.lookup(k, ctx) for k in loads]
        return verdicts, pending

    def all_blocks_out() -> bool:
        reader.step()  # vLLM's manager cascades the stores this step or the next
        return engine.gauges()["held_blocks"] == len(loads) + len(stores)

    def before_the_deadline() -> int:
        reader.store(stores, settle=False)
        reader.step()  # submits the promotion (loads) and the cascade (stores)
        # Held still until every block is out, inside the stopped volume: a
        # block still queued when the deadline passes is failed from the
        # queue, not stuck, and the stall would go unseen (CI, 1 run in many:
        # a busy machine's threads had taken none of the four by then).
        wait_until(all_blocks_out, "every block out in the stopped volume", DEADLINE_S / 2)
        loads_submitted = tier_clock.calls["submit_load"]
        clock.advance(JOB_TIMEOUT_S - JUST_BEFORE_S)
        verdicts, pending = steps()
        # Every block is stuck in the kernel or queued, and nothing is
        # failed before its deadline: no failure, no stall. The fresh keys'
        # checks sit in the kernel too (RETRY; a client cache may say MISS).
        assert counters[Direction.STORE, Failure.DEADLINE] == 0, dict(counters)
        assert not inside(engine).recheck_stalled()
        assert set(verdicts) <= {RETRY, MISS} and pending == [HIT_PENDING] * len(loads)
        return loads_submitted

    def past_the_deadline(loads_submitted: int) -> None:
        clock.advance(JUST_BEFORE_S)
        verdicts, pending = steps()
        # Stores failed at their deadline, all of them.
        assert counters[Direction.STORE, Failure.DEADLINE] == len(stores), dict(counters)
        assert inside(engine).recheck_stalled() and engine.gauges()["stuck_blocks"] >= 1
        # Lookups answer MISS; nothing new is promoted, so no load is submitted.
        assert verdicts == [MISS] * len(fresh)
        assert tier_clock.calls["submit_load"] == loads_submitted
        # The load job is not reported while its reads sit in the kernel: the
        # rows stay pending (vLLM cannot hand them out or reuse them).
        assert pending == [HIT_PENDING] * len(loads)
        # New stores are refused at once, whenever vLLM's manager cascades
        # them to the tier (the step after the CPU tier took them, or the
        # one after: it varied from run to run in worker mode).
        reader.store(refused, settle=False)
        for _ in range(STEPS):
            reader.step()
            if counters[Direction.STORE, Failure.STALLED] == len(refused):
                break
        assert counters[Direction.STORE, Failure.STALLED] == len(refused)

    with stopped(brick_pid(gluster)):
        loads_submitted = _returns(before_the_deadline)
        _returns(lambda: past_the_deadline(loads_submitted))
        stall_tier_max = tier_clock.max_s
        assert tier_clock.errors == []

    # SIGCONT: the reads return, the load job is reported, the stall clears.
    resumed = time.monotonic()
    reader.settle()

    def cleared() -> bool:
        reader.step()
        return not inside(engine).recheck_stalled()

    wait_until(cleared, "the stall to clear after SIGCONT")
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
    assert tier_clock.errors == []
    record(
        "stalled_brick",
        job_timeout_s=JOB_TIMEOUT_S,
        tier_calls=sum(tier_clock.calls.values()),
        slowest_tier_call_s=round(stall_tier_max, 4),
        stores_failed=counters[Direction.STORE, Failure.DEADLINE],
        stores_refused=counters[Direction.STORE, Failure.STALLED],
        loads_served_after=hits,
        wrong=wrong,
        recovered_s=round(recovered_s, 3),
        scheduler_exceptions=len(tier_clock.errors),
    )


# -- a write burst larger than the queue ------------------------------------------------

QUEUE_BOUND = 8
# A round of the burst: 24 blocks, 3x the bound, in jobs of 2 so that the
# queue fills to exactly its bound whatever the executor holds (2 or 4 places).
JOBS_PER_ROUND, BLOCKS_PER_JOB = 12, 2
ROUNDS = 12


def _land_in_cpu_tier(replica, batches) -> list:
    """Many requests' KV lands in the CPU tier (prepare_store and the
    stand-in for the GPU->CPU copy); returns (keys, ctx) per request for
    ``_complete``."""
    pending = []
    for batch in batches:
        ctx = replica.new_request()
        with replica.manager.lock:
            out = replica.manager.prepare_store(list(batch), ctx)
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            replica.rows[chunk, :] = np.frombuffer(payload_for(key, replica.row_bytes), np.int8)
        pending.append((batch, ctx))
    return pending


def _complete(replica, pending) -> None:
    """The scheduler completes those stores back to back (complete_store
    submits each to the tier at once): what one busy step looks like."""
    for batch, ctx in pending:
        with replica.manager.lock:
            replica.manager.complete_store(list(batch), ctx)
        replica.finish_request(ctx)


class _StoreGate:
    """The burst's stores held at the engine's ``enter`` pause point (before
    any I/O), in the tier's I/O threads or worker processes alike: closed,
    every store block that starts waits; ``hold`` keeps chosen keys waiting
    once it is open. Between rounds nothing is in flight, so closing it
    again (and forgetting who entered) is safe."""

    def __init__(self, engine, pause_dir: str):
        self.dir = pause_dir
        self.gate = Gate(engine, pause_dir, kinds=("store",))

    def entered(self) -> set[bytes]:
        return {key for _place, _kind, key in self.gate.entries}

    def hold(self, keys) -> None:
        for key in keys:
            self.gate.hold(key)

    def open(self) -> None:
        self.gate.open()

    def close(self) -> None:
        """Only between rounds: no block in flight."""
        for name in os.listdir(self.dir):
            if name == "open" or name.startswith(("at.", "hold.")):
                os.unlink(os.path.join(self.dir, name))

    def release_all(self) -> None:
        for name in os.listdir(self.dir):
            if name.startswith("hold."):
                os.unlink(os.path.join(self.dir, name))
        self.open()


def test_write_burst_drops_stores_and_loads_stay_fast(volume, replicas, request, io_mode):
    """A burst of stores 36x the store queue's bound, each round of it
    meeting a single-block load. Excess stores are refused at submit
    (queue_full) and the queue never exceeds its bound. Loads stay fast by
    construction rather than by a clock: every store the executor holds and
    every store queued is held still at the engine's pause point when the
    load arrives; then only the stores the executor already held are let go,
    and the load must complete while every store queued before it is still
    held. The read-priority places take loads first, so a load waits for
    the blocks already out of the queue, never for the queue (with the
    stores taken first, the load would wait behind held stores until
    ``find`` gave up)."""
    seeder = Replica(offloading_config(tiers=[ours(volume)]))
    replicas.append(seeder)
    load_keys = make_keys(ROUNDS * 2, seed="burst-load")
    seeder.store(load_keys)
    replica = Replica(
        offloading_config(
            # No deadline within the test's reach: stores wait at the gate
            # for as long as the test holds them, however slow the machine.
            tiers=[ours(volume, max_pending_store_blocks=QUEUE_BOUND, job_timeout_s=3600)],
            cpu_bytes=160 * MiB,
        )
    )
    replicas.append(replica)
    assert_io_mode(replica)
    clock = TierClock(replica.tier)
    engine, counters = replica.tier.engine, replica.tier.engine.counters
    layout = engine.roots[0].layout
    capacity = inside(
        engine
    ).executor.capacity()  # blocks the executor holds: threads, or workers x 2
    # Places running a block at once: each I/O thread (on tmpfs with 2 CPUs the
    # engine runs 1 + 1 of the 2 + 2 asked: startup/io_setup.io_thread_counts),
    # or each worker process.
    places = engine.io_workers or capacity
    assert JOBS_PER_ROUND * BLOCKS_PER_JOB - capacity > QUEUE_BOUND

    accepted: list[bytes] = []  # store blocks the engine queued, in submission order
    real_submit = engine.submit_store

    def submit_store(job_id, keys, chunks):
        taken = real_submit(job_id, keys, chunks)
        if taken:
            accepted.extend(keys)
        return taken

    engine.submit_store = submit_store

    def load_one(key, batches=()):
        """One single-block load. With ``batches``, the round's store jobs
        are submitted after the lookup said HIT and before the load is: the
        load meets a full store queue and a busy executor, all held."""
        ctx = replica.new_request()
        assert lookup_until(replica, [key], ctx) == {key: HIT_PENDING}
        queued: list[bytes] = []
        if batches:
            accepted.clear()
            pending = _land_in_cpu_tier(replica, batches)
            # Enough jobs to fill the executor: each fits, the executor
            # taking blocks as they come.
            fill = -(-capacity // BLOCKS_PER_JOB)
            _complete(replica, pending[:fill])
            held_by_executor(engine, capacity)
            gate.gate.wait_entered(places)
            in_executor = accepted[:capacity]  # the queue is FIFO
            assert gate.entered() <= set(in_executor)
            _complete(replica, pending[fill:])  # the queue fills; the rest is refused
            queued = accepted[capacity:]
            assert inside(engine).queued_store_blocks() == len(queued) == QUEUE_BOUND
            replica.step()  # submits the load: behind every queued store
            assert engine.gauges()["queued_load_blocks"] == 1
            written = counters[Outcome.WRITTEN]
            gate.hold(queued)
            gate.open()  # the stores the executor held go on; the queued ones stay
        final, _ = replica.find([key], ctx)
        assert final == {key: HIT}
        assert served(replica, [key], final, ctx) == (1, 0)
        replica.finish_request(ctx)
        if batches:
            # Done while every store queued before it is held, unwritten.
            assert not [k for k in queued if os.path.lexists(layout.block_path(k))]
            assert counters[Outcome.WRITTEN] - written <= capacity
            figures["queued_stores_overtaken"] += len(queued)
            gate.release_all()
            replica.settle()
            gate.close()

    figures = collections.Counter()
    for key in load_keys[:ROUNDS]:  # idle volume
        load_one(key)

    gate = _StoreGate(engine, io_mode.pause_dir)
    burst = make_keys(ROUNDS * JOBS_PER_ROUND * BLOCKS_PER_JOB, seed="burst-store")
    per_round = JOBS_PER_ROUND * BLOCKS_PER_JOB
    try:
        for i, key in enumerate(load_keys[ROUNDS:]):
            round_keys = burst[i * per_round : (i + 1) * per_round]
            batches = [
                round_keys[j : j + BLOCKS_PER_JOB] for j in range(0, per_round, BLOCKS_PER_JOB)
            ]
            load_one(key, batches)
    finally:
        gate.release_all()  # open for good: a failed round must not hold teardown
    replica.settle()

    dropped = counters[Direction.STORE, Failure.QUEUE_FULL]
    # Each round: the executor and the queue take their fill, the rest is refused.
    assert dropped == ROUNDS * (per_round - capacity - QUEUE_BOUND) > 0
    assert counters[Outcome.WRITTEN] + dropped == len(burst)
    assert len(block_files(layout.rank_dir)) == len(load_keys) + counters[Outcome.WRITTEN]
    assert clock.errors == []
    record(
        "write_burst",
        fs=request.node.callspec.params["volume"],
        queue_bound=QUEUE_BOUND,
        executor_capacity=capacity,
        burst_blocks=len(burst),
        dropped=dropped,
        written=counters[Outcome.WRITTEN],
        deepest_queue=QUEUE_BOUND,
        queued_stores_overtaken=figures["queued_stores_overtaken"],
        loads=len(load_keys),
        wrong=0,
        scheduler_exceptions=len(clock.errors),
    )
