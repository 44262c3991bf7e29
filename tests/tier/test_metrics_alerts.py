"""Every alert rule of docs/metrics.md, proven on a real tier: each test
drives vLLM's real TieringOffloadingManager with our tier into the state a
rule is written for and evaluates the documented expressions
(tests/kits/metrics_kit.py) on what Prometheus would scrape -- the rule
fires; on the same tier idle, none does. In both io modes (I/O threads and
worker processes).

Nothing here waits for time to pass: blocks are held still at the engine's
pause points (a Gate), and job deadlines and latencies run on a clock the
test moves (tests/kits/clock_kit.py).
"""

from __future__ import annotations

import os
import signal
import types
from collections.abc import Callable

import pytest

from llmkv_fs.engine.workers import crew
from tests.kits.engine_kit import inside
from tests.kits.metrics_kit import Scraper, documented_alerts, firing
from tests.kits.seal_kit import key_file
from tests.kits.tier_kit import make_keys, ours, resolve, start, wait_until
from tests.kits.volume_kit import flip_a_bit

pytestmark = pytest.mark.usefixtures("io_mode")

ALERTS = documented_alerts()
PROVEN: set[str] = set()  # the rules a test below drives a tier into
CHUNK = 64 * 1024  # small blocks: slices of up to 16 of them per place
SLOW_LOAD_S = 2.0  # LlmkvFsLoadLatencyHigh: p99 above 1 s


def proves(*alerts: str) -> Callable:
    PROVEN.update(alerts)
    return lambda test: test


@pytest.fixture
def replicas():
    made: list = []
    yield made
    for replica in reversed(made):
        replica.close()


def tier(replicas, root: str, **settings):
    """A replica of our tier on ``root`` with small blocks, and its scraper
    (whose first scrape is taken: the baseline of the counters)."""
    replica = start(replicas, ours(root, **settings), block_bytes=CHUNK, cpu_bytes=32 << 20)
    scraper = Scraper(replica)
    return replica, scraper, scraper.scrape()


def idle_fires_nothing(replica, scraper) -> dict:
    """The tier at rest fires no rule; returns the scrape to measure from."""
    replica.settle()
    before = scraper.scrape()
    assert firing(ALERTS, before, scraper.scrape()) == set()
    return scraper.scrape()


def request_loads(replica, keys, submitted: Callable[[], bool]) -> object:
    """A request finds ``keys`` on our tier (not in the CPU tier): step
    until vLLM has submitted their promotion (``submitted()``: as the
    engine shows it). Returns the request."""
    ctx = replica.new_request()

    def looked_up() -> bool:
        with replica.manager.lock:
            for key in keys:
                replica.manager.lookup(key, ctx)
        replica.step()
        return submitted()

    wait_until(looked_up, "the promotions to be submitted")
    return ctx


def written_by_another_replica(replicas, root: str, keys) -> None:
    """``keys`` on the volume and not in the test replica's CPU tier."""
    writer = start(replicas, ours(root, io_workers=0), block_bytes=CHUNK, cpu_bytes=32 << 20)
    writer.store(keys)


# -- at rest ------------------------------------------------------------------------------


def test_an_idle_tier_fires_no_alert(tmp_path, replicas):
    replica, scraper, before = tier(replicas, str(tmp_path))
    keys = make_keys(4, seed="idle")
    replica.store(keys)
    replica.settle()
    assert firing(ALERTS, before, scraper.scrape()) == set()  # work done, none failed
    idle_fires_nothing(replica, scraper)


# -- saturated -----------------------------------------------------------------------------


@proves(
    "LlmkvFsSaturated", "LlmkvFsLoadsWaiting", "LlmkvFsStoreQueueFull", "LlmkvFsLoadLatencyHigh"
)
def test_a_saturated_tier_fires_saturation_waiting_loads_and_drops(
    tmp_path, replicas, gate_on, engine_clock
):
    root = str(tmp_path)
    promoted = make_keys(2, seed="promoted")
    written_by_another_replica(replicas, root, promoted)
    replica, scraper, _ = tier(replicas, root, max_pending_store_blocks=64)
    engine = replica.tier.engine
    before = idle_fires_nothing(replica, scraper)
    places = engine.gauges()["io_places"]
    assert places == inside(engine).executor.capacity()

    # The volume answers no store: one large store job fills every place
    # (each with a slice of several blocks), the rest of it waits in the
    # queue, and a further store does not fit the bound.
    gate = gate_on(engine, ("store",))
    replica.store(make_keys(160, seed="burst"), settle=False)
    wait_until(lambda: engine.gauges()["busy_places"] == places, "every place to hold a slice")
    replica.store(make_keys(8, seed="dropped"), settle=False)
    ctx = request_loads(
        replica, promoted, lambda: engine.gauges()["queued_load_blocks"] == len(promoted)
    )

    gauges = engine.gauges()
    assert gauges["busy_places"] == places  # of places, never more
    assert gauges["held_blocks"] > places  # what places hold: slices of many blocks
    assert gauges["queued_load_blocks"] == len(promoted)
    saturated = scraper.scrape()
    assert firing(ALERTS, before, saturated) == {
        "LlmkvFsSaturated",
        "LlmkvFsLoadsWaiting",
        "LlmkvFsStoreQueueFull",
    }

    # The promotions waited SLOW_LOAD_S for a place: their latency says so
    # once they are done, and the tier at rest is no longer saturated.
    engine_clock.advance(SLOW_LOAD_S)
    gate.open()
    replica.settle()
    replica.finish_request(ctx)
    after = scraper.scrape()
    assert firing(ALERTS, saturated, after) == {"LlmkvFsLoadLatencyHigh"}
    assert firing(ALERTS, after, scraper.scrape()) == set()


# -- a volume that stops answering ---------------------------------------------------------


@proves("LlmkvFsVolumeStalled", "LlmkvFsStoreErrors", "LlmkvFsLoadErrors")
def test_a_stalled_volume_fires_stalled_then_store_and_load_errors(
    tmp_path, replicas, gate_on, engine_clock
):
    root = str(tmp_path)
    promoted = make_keys(1, seed="stalled-load")
    written_by_another_replica(replicas, root, promoted)
    replica, scraper, _ = tier(replicas, root, job_timeout_s=1.0)
    engine = replica.tier.engine
    before = idle_fires_nothing(replica, scraper)

    gate = gate_on(engine, ("store", "load"))
    replica.store(make_keys(2, seed="stalled-store"), settle=False)
    ctx = request_loads(replica, promoted, lambda: any(e[1] == "load" for e in gate.entries))
    wait_until(lambda: engine.gauges()["held_blocks"] == 3, "every block held by the volume")
    engine_clock.advance(1.0)  # the jobs' deadline: their blocks are stuck in the volume
    wait_until(lambda: replica.step() or inside(engine).recheck_stalled(), "the deadline to pass")
    stalled = scraper.scrape()
    # The store is reported failed at once (its blocks will never publish);
    # the load only when its read is back.
    assert firing(ALERTS, before, stalled) == {"LlmkvFsVolumeStalled", "LlmkvFsStoreErrors"}

    gate.open()
    replica.settle()
    # The failed store is finished; its blocks leave the volume's calls a
    # little later (they were stuck: nothing waits on them but this gauge).
    wait_until(
        lambda: replica.step() or engine.gauges()["stuck_blocks"] == 0, "the calls to return"
    )
    replica.finish_request(ctx)
    answered = scraper.scrape()
    assert firing(ALERTS, stalled, answered) == {"LlmkvFsLoadErrors"}
    assert firing(ALERTS, answered, scraper.scrape()) == set()


# -- the volume's state ----------------------------------------------------------------------


@proves("LlmkvFsVolumeFailed")
def test_an_unmounted_volume_fires_volume_failed(tmp_path, replicas):
    root = str(tmp_path / "kv")
    os.makedirs(root)
    replica, scraper, _ = tier(replicas, root)
    before = idle_fires_nothing(replica, scraper)
    os.rename(root, root + ".gone")  # unmounted; an empty directory in its place
    os.makedirs(root)
    engine = replica.tier.engine
    wait_until(
        inside(engine).recheck_volume_failed, "the housekeeping thread to see the root replaced"
    )
    assert firing(ALERTS, before, scraper.scrape()) == {"LlmkvFsVolumeFailed"}


@proves("LlmkvFsSpaceGuardTripped")
def test_a_full_volume_fires_space_guard_tripped(tmp_path, replicas):
    idle, idle_scraper, _ = tier(replicas, str(tmp_path / "roomy"))
    idle_fires_nothing(idle, idle_scraper)
    # This replica wants 1 EiB free: its volume is full by its settings.
    replica, scraper, before = tier(replicas, str(tmp_path / "full"), min_free_bytes=1 << 60)
    guard = replica.tier.engine.roots[0].guard
    wait_until(lambda: not guard.allows_store(), "the space guard to trip")
    assert firing(ALERTS, before, scraper.scrape()) == {"LlmkvFsSpaceGuardTripped"}


@proves("LlmkvFsCorruptBlocks")
def test_a_flipped_bit_fires_corrupt_blocks(tmp_path, replicas):
    root = str(tmp_path)
    keys = make_keys(1, seed="flipped")
    written_by_another_replica(replicas, root, keys)
    replica, scraper, _ = tier(replicas, root)
    before = idle_fires_nothing(replica, scraper)
    flip_a_bit(replica.tier.engine.roots[0].layout.block_path(keys[0]))
    replica.find(keys)
    replica.settle()
    assert firing(ALERTS, before, scraper.scrape()) == {"LlmkvFsCorruptBlocks"}


# -- worker processes --------------------------------------------------------------------


@proves("LlmkvFsWorkerDeaths", "LlmkvFsWorkersMissing")
def test_workers_that_die_and_cannot_restart_fire_deaths_and_missing(
    tmp_path, replicas, io_mode, monkeypatch
):
    if not io_mode.workers:
        pytest.skip("I/O threads do not die (the idle and saturated tests: these never fire)")
    replica, scraper, _ = tier(replicas, str(tmp_path))
    before = idle_fires_nothing(replica, scraper)
    executor = inside(replica.tier.engine).executor
    configured = len(executor.worker_pids())
    # A replacement that cannot start (a broken interpreter): it dies
    # before it is ready, again and again.
    monkeypatch.setattr(crew, "sys", types.SimpleNamespace(executable="/bin/false"))
    os.kill(executor.worker_pids()[0], signal.SIGKILL)
    wait_until(
        lambda: executor.deaths() >= 2 and len(executor.worker_pids()) == configured - 1,
        "the worker and its first replacement to die",
    )
    replica.step()  # the owner copies the executor's deaths into the counters
    assert firing(ALERTS, before, scraper.scrape()) == {
        "LlmkvFsWorkerDeaths",
        "LlmkvFsWorkersMissing",
    }


@proves("LlmkvFsLookupsMissForAReason")
def test_lookups_missing_sealed_blocks_of_another_key_fire_miss_for_a_reason(tmp_path, replicas):
    root = str(tmp_path / "v")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    keys = make_keys(4, seed="foreign")
    writer = start(
        replicas,
        ours(root, io_workers=0, seal_key_files={"1": key_file(secrets, "theirs")}),
        block_bytes=CHUNK,
        cpu_bytes=32 << 20,
    )
    writer.store(keys)
    # Same key id, another key: each block is found, its load refused
    # (foreign_key) and remembered; every later request misses it.
    replica, scraper, _ = tier(replicas, root, seal_key_files={"1": key_file(secrets, "ours")})
    before = idle_fires_nothing(replica, scraper)
    for _ in range(3):
        resolve(replica, keys)
    replica.settle()
    assert firing(ALERTS, before, scraper.scrape()) == {"LlmkvFsLookupsMissForAReason"}


def test_every_documented_rule_is_proven_here():
    """A new rule in docs/metrics.md needs a test above that drives a tier
    into it."""
    assert set(ALERTS) == PROVEN, set(ALERTS) ^ PROVEN
