"""Why lookups miss, counted through vLLM's real offloading stack and
scraped as Prometheus would (tests/kits/metrics_kit.py), in both I/O
modes: each reason is driven here -- a block never stored, a root lost, a
block sealed with another key (then remembered), a corrupt block (its load
failed), a block without a checksum (remembered as bad), a check held past
the lookup deadline (then the volume stalled) -- and counted under its own
reason, and the reasons sum to ``lookups{result="miss"}``. A check that
fails (``check_failed``) is driven in tests/engine/test_lookup.py: checks
run on the engine's own lookup thread in both I/O modes, and a volume shut
down under the tier (ext4's EXT4_IOC_SHUTDOWN) still answers a missing name
from its cache, not with EIO."""

from __future__ import annotations

import os

import pytest
from vllm.v1.kv_offload.base import LookupResult

from llmkv_fs.tier.metrics import PREFIX
from tests.kits.engine_kit import inside
from tests.kits.metrics_kit import Scraper
from tests.kits.seal_kit import key_file
from tests.kits.tier_kit import make_keys, ours, resolve, start, wait_until
from tests.kits.volume_kit import block_files, flip_a_bit

pytestmark = pytest.mark.usefixtures("io_mode")

CHUNK = 64 * 1024


def grown(before: dict, after: dict, name: str, label: str) -> dict[str, float]:
    """A counter family's growth between two scrapes, by one label."""
    out: dict[str, float] = {}
    for (sample, labels), value in after.items():
        if sample != name:
            continue
        by = dict(labels)[label]
        out[by] = out.get(by, 0.0) + value - before.get((sample, labels), 0.0)
    return {k: v for k, v in out.items() if v}


def misses(scraper: Scraper, before: dict) -> dict[str, float]:
    """Misses by reason since ``before``, asserting they sum to the misses."""
    after = scraper.scrape()
    reasons = grown(before, after, PREFIX + "lookup_misses_total", "reason")
    answers = grown(before, after, PREFIX + "lookups_total", "result")
    assert sum(reasons.values()) == answers.get("miss", 0.0), (reasons, answers)
    return reasons


def replica_on(replicas, root: str, **settings):
    replica = start(replicas, ours(root, **settings), block_bytes=CHUNK, cpu_bytes=32 << 20)
    scraper = Scraper(replica)
    return replica, scraper, scraper.scrape()


def test_a_block_never_stored_misses_not_on_the_volume(tmp_path, replicas):
    replica, scraper, before = replica_on(replicas, str(tmp_path / "v"))
    resolve(replica, make_keys(3, seed="never"))
    assert misses(scraper, before) == {"not_on_volume": 3}


def test_a_lost_root_misses_lost_root(tmp_path, replicas):
    root = str(tmp_path / "v")
    replica, scraper, before = replica_on(replicas, root)
    engine = replica.tier.engine
    os.rename(root, root + ".gone")
    wait_until(lambda: replica.step() or engine.roots[0].lost, "the root to be lost")
    resolve(replica, make_keys(2, seed="lost"))
    assert misses(scraper, before) == {"lost_root": 2}


def test_sealed_blocks_of_another_key_miss_foreign_key(tmp_path, replicas):
    root = str(tmp_path / "v")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    keys = make_keys(2, seed="sealed")
    writer = start(
        replicas,
        ours(root, seal_key_files={"1": key_file(secrets, "a")}),
        block_bytes=CHUNK,
        cpu_bytes=32 << 20,
    )
    writer.store(keys)
    assert len(block_files(root)) == 2
    replica, scraper, before = replica_on(
        replicas, root, seal_key_files={"1": key_file(secrets, "b")}
    )
    # Found: HIT_PENDING, the load refused, then MISS. One key a request, so
    # each is a load job of its own: in one job of both, the second block is
    # skipped after the first fails, or refused in parallel, as the I/O
    # threads happen to take them (and a skipped block is no foreign key).
    for key in keys:
        resolve(replica, [key])
    replica.settle()
    first = misses(scraper, before)
    assert set(first) <= {"foreign_key"}
    before = scraper.scrape()
    resolve(replica, keys)  # a new request: remembered, no probe
    assert misses(scraper, before) == {"foreign_key": 2}


def test_a_corrupt_block_misses_load_failed(tmp_path, replicas):
    root = str(tmp_path / "v")
    key = make_keys(1, seed="corrupt")
    writer = start(replicas, ours(root), block_bytes=CHUNK, cpu_bytes=32 << 20)
    writer.store(key)
    (path,) = block_files(root)
    flip_a_bit(path, 100)
    replica, scraper, before = replica_on(replicas, root)
    # Found, promoted, its load fails verification (moved aside): MISS.
    assert resolve(replica, key) == {key[0]: LookupResult.MISS}
    assert misses(scraper, before) == {"load_failed": 1}


def test_a_block_written_without_a_checksum_misses_remembered_bad(tmp_path, replicas):
    """A block written with checksum: false, read by a replica that wants
    one: its load is refused and the file left in place, remembered, so the
    next request's lookup answers MISS without a probe."""
    root = str(tmp_path / "v")
    keys = make_keys(2, seed="no-checksum")
    start(replicas, ours(root, checksum=False), block_bytes=CHUNK, cpu_bytes=32 << 20).store(keys)
    replica, scraper, _ = replica_on(replicas, root)
    resolve(replica, keys)  # found, the load refused (no_checksum)
    replica.settle()
    before = scraper.scrape()
    assert resolve(replica, keys[:1]) == {keys[0]: LookupResult.MISS}
    assert misses(scraper, before) == {"remembered_bad": 1}


def test_a_check_held_past_the_deadline_misses_stalled_then_deadline(
    tmp_path, replicas, gate_on, engine_clock
):
    """A check held inside the volume (the exists pause point) past the
    lookup deadline: the volume is stalled, and every lookup meanwhile is
    refused, ``stalled``; once it answers again, the request whose key the
    deadline decided still misses it, ``deadline`` (the late answer is not
    taken)."""
    replica, scraper, before = replica_on(replicas, str(tmp_path / "v"), job_timeout_s=1.0)
    engine = replica.tier.engine
    gate = gate_on(engine, ("lookup",), point="exists")
    (held, later) = make_keys(2, seed="deadline")
    ctx = replica.new_request()

    def checking() -> bool:
        with replica.manager.lock:
            replica.manager.lookup(held, ctx)
        replica.step()
        return bool(gate.entries)

    wait_until(checking, "the check to reach the volume")
    engine_clock.advance(1.0)  # the lookup deadline: min(job_timeout_s, 5 s)
    assert replica.find([held], ctx)[0] == {held: LookupResult.MISS}
    assert inside(engine).recheck_stalled()
    assert resolve(replica, [later]) == {later: LookupResult.MISS}
    gate.open()
    wait_until(
        lambda: replica.step() or not inside(engine).recheck_stalled(), "the volume to answer"
    )
    assert replica.find([held], ctx)[0] == {held: LookupResult.MISS}
    replica.finish_request(ctx)
    assert misses(scraper, before) == {"stalled": 2, "deadline": 1}
