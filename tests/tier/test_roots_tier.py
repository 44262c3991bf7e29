"""Several roots through vLLM's real scheduler-side stack
(TieringOffloadingSpec, both io modes): replicas listing the same roots in
another order share every block; a replica with one root more still finds
what the others wrote; a comma without path_sharding is one directory."""

from __future__ import annotations

import os

import pytest
from vllm.v1.kv_offload.base import LookupResult

from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.rootlist import RootListError
from tests.kits.engine_kit import inside
from tests.kits.tier_kit import (
    MiB,
    make_keys,
    ours,
    payload_for,
    read_primary,
    resolve,
    start,
    wait_until,
)
from tests.kits.volume_kit import block_files

pytestmark = pytest.mark.usefixtures("io_mode")
SHARDED = {"path_sharding": "by_block_hash"}


def roots_in(tmp_path, *names: str) -> list[str]:
    return [str(tmp_path / name / "kv") for name in names]


def served(replica, keys) -> bool:
    """Every key HIT, and its bytes in the CPU tier are what was stored."""
    final = resolve(replica, keys)
    if any(final[key] is not LookupResult.HIT for key in keys):
        return False
    ctx = replica.new_request()
    try:
        return all(
            read_primary(replica, key, ctx) == payload_for(key, replica.row_bytes) for key in keys
        )
    finally:
        replica.finish_request(ctx)


def keys_homed_on_each(roots: list[str], each: int, seed: str) -> list[bytes]:
    """``each`` keys whose home is each of ``roots`` (the placement follows
    the roots' spelling, a temporary path here: keys drawn blindly could
    leave a root with none)."""
    placement = RootPlacement(roots)
    homed: dict[int, list[bytes]] = {index: [] for index in range(len(roots))}
    for key in make_keys(200 * each * len(roots), seed):
        home = homed[placement.home(key)]
        if len(home) < each:
            home.append(key)
        if all(len(keys) == each for keys in homed.values()):
            return [key for keys in homed.values() for key in keys]
    raise AssertionError("no key homed on some root")


def test_replicas_listing_the_roots_in_another_order_share_every_block(tmp_path, replicas):
    roots = roots_in(tmp_path, "nvme0", "nvme1", "nvme2")
    keys = keys_homed_on_each(roots, 8, "shared")
    writer = start(replicas, ours(",".join(roots), **SHARDED))
    writer.store(keys)
    per_root = {root: len(block_files(root)) for root in roots}
    assert per_root == dict.fromkeys(roots, 8)  # each block on its home root
    reader = start(replicas, ours(",".join(reversed(roots)), **SHARDED))
    assert served(reader, keys)
    assert reader.tier.config_info()["llmkv_fs_roots"] == 3


def test_a_replica_with_a_root_more_finds_what_the_others_wrote(tmp_path, replicas):
    roots = roots_in(tmp_path, "nvme0", "nvme1")
    keys = make_keys(24, "before")
    start(replicas, ours(",".join(roots), **SHARDED)).store(keys)
    grown = start(replicas, ours(",".join([*roots, *roots_in(tmp_path, "nvme2")]), **SHARDED))
    assert served(grown, keys)


def test_a_comma_without_path_sharding_is_one_directory(tmp_path, replicas, caplog):
    root = str(tmp_path / "team,a")
    replica = start(replicas, ours(root))
    replica.store(make_keys(2, "comma"))
    assert len(block_files(root)) == 2
    assert not os.path.exists(str(tmp_path / "team"))
    assert "contains a comma and is used as one directory" in caplog.text


@pytest.mark.parametrize("case", ["empty entry", "through a symlink"])
def test_a_bad_root_list_stops_start_up_naming_the_entry(case, tmp_path, replicas):
    real = tmp_path / "real"
    real.mkdir()
    if case == "empty entry":
        root_dir, named = f"{real},,{tmp_path / 'other'}", "entry 2 is empty"
    else:
        os.symlink(real, tmp_path / "link")
        root_dir, named = f"{tmp_path / 'other'},{real},{tmp_path / 'link'}", "entry 3"
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(RootListError, match=named):
        start(replicas, ours(root_dir, **SHARDED))
    assert sorted(os.listdir(tmp_path)) == before  # "other" not created either
    assert os.listdir(real) == []


def test_a_lost_root_back_serves_what_lookups_missed_while_it_was_lost(tmp_path, replicas):
    """A request open across the loss asked for the root's keys; their check
    ran while the root was lost (a miss without a look). Once the root is
    back, a new request gets its blocks: the verdict of the loss, shared
    while that request is open, does not outlive it."""
    roots = roots_in(tmp_path, "a", "b", "c")
    replica = start(replicas, ours(",".join(roots), **SHARDED), cpu_bytes=8 * MiB)
    engine = replica.tier.engine
    keys = make_keys(36, "lost-and-back")
    for i in range(0, len(keys), 3):
        replica.store(keys[i : i + 3])
    # Out of the CPU tier (4 chunks) by now, on the root that will be lost.
    on_b = [key for key in keys[:24] if inside(engine).placement.home(key) == 1][:3]
    assert len(on_b) == 3
    serving = replica.new_request()
    with replica.manager.lock:
        asked = [replica.manager.lookup(key, serving) for key in on_b]
    assert asked == [LookupResult.RETRY] * 3  # their checks wait for the step's batch
    os.rename(tmp_path / "b", tmp_path / "b-away")
    os.makedirs(tmp_path / "b" / "kv")
    wait_until(lambda: engine.roots[1].lost, "the housekeeping thread to see root b lost")
    during, _ = replica.find(on_b, serving)  # the batch is checked while b is lost
    assert set(during.values()) == {LookupResult.MISS}
    os.rename(tmp_path / "b", tmp_path / "b-empty")
    os.rename(tmp_path / "b-away", tmp_path / "b")
    wait_until(lambda: not engine.roots[1].lost, "the housekeeping thread to see root b back")
    replica.step()  # the engine sees it
    after = {key: resolve(replica, [key])[key] for key in on_b}  # while serving is open
    replica.finish_request(serving)
    assert set(after.values()) == {LookupResult.HIT}
    assert served(replica, on_b)
