"""gc's rules on real trees (every filesystem of the ``volume`` fixture):
orphaned digests, leases, --keep/--model, temp files, LRU eviction with
--protect, empty directories, symlinks, dry run."""

import math
import os
import re
import time

import pytest

from llmkv_fs.layout.names import TRASH_PREFIX
from tests.kits.gc_kit import (
    DAY,
    HOST,
    age,
    cache_entries,
    dead_pid,
    gc,
    key,
    make_digest,
    put_block,
    put_lease,
    put_temp,
    snapshot,
)

OLD = 8 * DAY
QUIET = ("--high", "off")  # capacity rules off unless a test asks for them


def digest_dirs(layouts):
    return [layouts[0].base_path] + [layout.rank_dir for layout in layouts]


def present(paths):
    return [os.path.exists(p) for p in paths]


# -- orphaned digests ----------------------------------------------------------------


def test_old_unleased_digest_is_removed_with_every_rank(volume, capsys):
    old = make_digest(volume, "acme/old", ranks=(0, 1), config_age=OLD)
    for layout in old:
        for i in range(3):
            put_block(layout, key(i, layout.rank_dir), OLD, OLD)
    fresh = make_digest(volume, "acme/fresh", config_age=OLD)
    put_block(fresh[0], key(0), OLD)
    used = put_block(fresh[0], key(1), OLD, used_ago=3600)  # loaded an hour ago: atime stamp
    stamped = os.stat(used).st_atime

    before = time.time()
    status, report = gc(volume, *QUIET, capsys=capsys)
    after = time.time()
    assert status == 0, report
    assert present(digest_dirs(old)) == [False, False, False]
    assert present(digest_dirs(fresh)) == [True, True]
    assert len(cache_entries(fresh[0].rank_dir)) == 2
    by_name = {d["name"]: d for d in report["digests"]}
    assert by_name[old[0].digest_dir_name]["removed"]
    assert not by_name[fresh[0].digest_dir_name]["removed"]
    # An hour ago plus however long the test took to get here (seconds on a
    # loaded machine or a FUSE mount): what gc's clock can have read, between
    # the instants before and after it ran.
    idle = re.search(r"used (\d+)s ago", by_name[fresh[0].digest_dir_name]["why"])
    assert idle and int(idle[1]) >= 3600
    assert math.floor(before - stamped) <= int(idle[1]) <= math.ceil(after - stamped)
    # Nothing of gc's own is left in the root but its lock file.
    assert sorted(os.listdir(volume)) == sorted(
        [".llmkv-gc.lock", fresh[0].digest_dir_name, os.path.basename(fresh[0].rank_dir)]
    )


def test_builtin_digest_without_leases_is_judged_by_age(volume, capsys):
    # vLLM's built-in tier: config.json and trailer-less blocks, no leases dir.
    stale = make_digest(volume, "builtin/stale", config_age=OLD)
    put_block(stale[0], key(0), OLD, payload=8192)
    recent = make_digest(volume, "builtin/recent", config_age=OLD)
    put_block(recent[0], key(0), OLD)
    put_block(recent[0], key(1), 6 * DAY)  # within --min-age 7d
    starting = make_digest(volume, "builtin/starting")  # config.json only, just written
    assert not os.path.exists(f"{stale[0].base_path}/leases")

    status, _ = gc(volume, *QUIET, capsys=capsys)
    assert status == 0
    assert present(digest_dirs(stale)) == [False, False]
    assert present(digest_dirs(recent)) == [True, True]
    assert present(digest_dirs(starting)) == [True, True]
    # A shorter --min-age takes the recent one too.
    status, _ = gc(volume, *QUIET, "--min-age", "5d", capsys=capsys)
    assert present(digest_dirs(recent)) == [False, False]
    assert present(digest_dirs(starting)) == [True, True]


@pytest.mark.parametrize(
    "lease_kind, removed",
    [
        ("live-this-host", False),
        ("live-other-host", False),
        ("stale-heartbeat", True),
        ("dead-pid-this-host", True),
    ],
)
def test_leases_live_stale_and_dead_pid(volume, capsys, lease_kind, removed):
    layouts = make_digest(volume, "acme/leased", config_age=OLD)
    put_block(layouts[0], key(0), OLD, OLD)
    if lease_kind == "live-this-host":
        put_lease(layouts[0], os.getpid())
    elif lease_kind == "live-other-host":
        put_lease(layouts[0], 4242, host="other-node")
    elif lease_kind == "stale-heartbeat":  # 4 intervals of 30 s without a refresh
        put_lease(layouts[0], 4242, host="other-node", seconds_old=5 * 30)
    else:  # a fresh heartbeat, but the process on this host is gone
        put_lease(layouts[0], dead_pid())

    status, report = gc(volume, *QUIET, capsys=capsys)
    assert status == 0
    assert present(digest_dirs(layouts)) == [not removed] * 2
    (entry,) = report["digests"]
    assert entry["removed"] is removed
    if not removed:
        assert "live lease" in entry["why"]


def test_pid_check_off_trusts_heartbeats_only(volume, capsys):
    layouts = make_digest(volume, "acme/sidecar", config_age=OLD)
    put_block(layouts[0], key(0), OLD, OLD)
    put_lease(layouts[0], dead_pid())  # fresh heartbeat, pid not in "our" namespace
    gc(volume, *QUIET, "--pid-check", "off", capsys=capsys)
    assert present(digest_dirs(layouts)) == [True, True]
    gc(volume, *QUIET, "--pid-check", "on", capsys=capsys)
    assert present(digest_dirs(layouts)) == [False, False]


def test_keep_pins_and_model_filters(volume, capsys):
    a = make_digest(volume, "org/a", config_age=OLD)
    b = make_digest(volume, "org/b", config_age=OLD)
    c = make_digest(volume, "org/c", config_age=OLD)
    d = make_digest(volume, "org/c", dtype="float16", config_age=OLD)  # same model, other digest
    for layouts in (a, b, c, d):
        put_block(layouts[0], key(0), OLD, OLD)

    gc(volume, *QUIET, "--model", "org/a", "--model", "org_b", "--keep", b[0].digest, capsys=capsys)
    assert present(digest_dirs(a)) == [False, False]
    assert present(digest_dirs(b)) == [True, True]  # pinned by digest
    assert present(digest_dirs(c)) == [True, True]  # not selected
    gc(volume, *QUIET, "--keep", c[0].digest_dir_name, capsys=capsys)
    assert present(digest_dirs(c)) == [True, True]  # pinned by directory name
    assert present(digest_dirs(d)) == [False, False]
    assert present(digest_dirs(b)) == [False, False]
    gc(volume, *QUIET, "--keep", "org/c", capsys=capsys)  # pinned by model
    assert present(digest_dirs(c)) == [True, True]


def test_pinned_digest_is_never_evicted(volume, capsys):
    pinned = make_digest(volume, "org/pinned")
    other = make_digest(volume, "org/other")
    p = [put_block(pinned[0], key(i, "p"), 3 * DAY) for i in range(4)]
    o = [put_block(other[0], key(i, "o"), DAY) for i in range(4)]
    _status, report = gc(
        volume, "--high", "off", "--max-bytes", "0", "--keep", "org/pinned", capsys=capsys
    )
    assert present(p) == [True] * 4
    assert present(o) == [False] * 4
    assert report["capacity"]["short_bytes"] > 0


# -- temp files --------------------------------------------------------------------


def test_temp_files_of_dead_writers_go_live_ones_stay(volume, capsys):
    layouts = make_digest(volume, "acme/tmp")
    layout = layouts[0]
    put_block(layout, key(0), 60)
    gone = dead_pid()
    dead_here = put_temp(layout, key(1), gone)  # fresh, provably dead
    live_here_old = put_temp(layout, key(2), os.getpid(), seconds_old=DAY)  # never removed
    other_fresh = put_temp(layout, key(3), 777, host="other-node", seconds_old=60)
    other_old = put_temp(layout, key(4), 777, host="other-node", seconds_old=2 * 3600)
    # A dead writer's config.json and lease temp files in the config directory.
    cfg_tmp = f"{layout.base_path}/.config.json.{HOST}~{gone}~abc.tmp"
    lease_tmp = f"{layout.base_path}/leases/.{HOST}~{gone}~1.json.other~{gone}~abc.tmp"
    for path in (cfg_tmp, lease_tmp):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()
        age(path, 7200)

    # vLLM's built-in tier names no writer: age alone decides. Our O_DIRECT
    # probe names its writer.
    block = layout.block_path(key(5))
    vllm_old, vllm_fresh = block + "_123.tmp", layout.block_path(key(6)) + "_456.tmp"
    probe = f"{layout.rank_dir}/.llmkv_fs_o_direct_probe.{HOST}~{gone}"
    for path, seconds in ((vllm_old, 7200), (vllm_fresh, 60), (probe, 60)):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()
        age(path, seconds)

    status, report = gc(volume, *QUIET, capsys=capsys)
    assert status == 0
    assert present([dead_here, live_here_old, other_fresh, other_old, cfg_tmp, lease_tmp]) == [
        False,
        True,
        True,
        False,
        False,
        False,
    ]
    assert present([vllm_old, vllm_fresh, probe]) == [False, True, False]
    assert report["temps"]["removed"] == 6 and report["temps"]["kept"] == 3
    # A shorter --tmp-age takes the other host's fresh one too, never the live writer's.
    gc(volume, *QUIET, "--tmp-age", "30s", capsys=capsys)
    assert present([live_here_old, other_fresh, vllm_fresh]) == [True, False, False]


# -- capacity: LRU and --protect ------------------------------------------------------------


def test_max_bytes_evicts_least_recently_used_first(volume, capsys):
    layouts = make_digest(volume, "acme/lru")
    layout = layouts[0]
    lease = put_lease(layout, os.getpid())
    # Stored long ago; last used i hours ago (atime stamps), block 9 only stored.
    paths = [
        put_block(layout, key(i), seconds_old=10 * DAY, used_ago=(i + 1) * 3600) for i in range(9)
    ]
    paths.append(put_block(layout, key(9), seconds_old=11 * 3600))
    size = os.lstat(paths[0]).st_blocks * 512
    cache = sum(os.lstat(f"{volume}/{p}").st_blocks * 512 for p in cache_entries(volume))
    # --max-bytes counts everything under the digest (config.json, leases
    # too): ask for 3.5 blocks' worth to go, so 4 go.
    status, report = gc(
        volume, *QUIET, "--max-bytes", str(cache - 3 * size - size // 2), capsys=capsys
    )
    assert status == 0, report
    gone = {i for i, p in enumerate(paths) if not os.path.exists(p)}
    # Last use, oldest first: 9 (stored 11h ago), 8 (loaded 9h ago), 7 (8h), 6 (7h).
    assert gone == {9, 8, 7, 6}
    cap = report["capacity"]
    assert cap["evicted_blocks"] == 4 and cap["evicted_bytes"] == 4 * size
    assert os.path.exists(layout.config_path) and os.path.exists(lease)


def test_protect_spares_recent_blocks_and_reports_the_shortfall(volume, capsys):
    layouts = make_digest(volume, "acme/protect")
    old = [put_block(layouts[0], key(i), DAY) for i in range(3)]
    recent = [put_block(layouts[0], key(10 + i), DAY, used_ago=120) for i in range(3)]
    status, report = gc(volume, *QUIET, "--max-bytes", "0", "--protect", "10m", capsys=capsys)
    assert status == 0
    assert present(old) == [False] * 3
    assert present(recent) == [True] * 3
    # Short by what is left: the protected blocks, and config.json (never evicted).
    left = sum(os.lstat(f"{volume}/{p}").st_blocks * 512 for p in cache_entries(volume))
    assert report["capacity"]["short_bytes"] == left
    assert os.path.exists(layouts[0].config_path)
    gc(volume, *QUIET, "--max-bytes", "0", "--protect", "1m", capsys=capsys)
    assert present(recent) == [False] * 3


# -- directories and symlinks --------------------------------------------------------------


def test_empty_directories_are_pruned_bottom_up(volume, capsys):
    layouts = make_digest(volume, "acme/dirs")
    layout = layouts[0]
    evicted = put_block(layout, key(0), DAY)
    stays = put_block(layout, key(1), 60)
    fresh_empty = f"{layout.rank_dir}/fff/ff_g0"
    old_empty = f"{layout.rank_dir}/eee/ee_g0"
    os.makedirs(fresh_empty)
    os.makedirs(old_empty)
    for path in (old_empty, os.path.dirname(old_empty)):
        age(path, 3600)
    status, report = gc(volume, *QUIET, "--max-bytes", "8192", "--protect", "10m", capsys=capsys)
    assert status == 0, report
    assert not os.path.exists(evicted)
    assert not os.path.exists(os.path.dirname(evicted))
    assert not os.path.exists(os.path.dirname(os.path.dirname(evicted)))
    assert not os.path.exists(os.path.dirname(old_empty))
    assert os.path.isdir(fresh_empty)  # younger than --protect: a writer may be about to use it
    assert os.path.exists(stays)
    assert os.path.isdir(layout.rank_dir)  # the rank directory itself stays
    assert report["dirs_pruned"] == 4


def test_symlinks_are_never_followed_or_deleted_through(volume, tmp_path, capsys):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    target_file = outside / "precious.bin"
    target_file.write_bytes(b"x" * 8192)
    (outside / "sub" / "a.bin").write_bytes(b"y" * 8192)
    for p in (target_file, outside / "sub" / "a.bin", outside / "sub"):
        age(str(p), 30 * DAY)

    live = make_digest(volume, "acme/live")
    put_lease(live[0], os.getpid())
    real = put_block(live[0], key(0), DAY)
    link_block = live[0].block_path(key(1))
    os.makedirs(os.path.dirname(link_block), exist_ok=True)
    os.symlink(target_file, link_block)  # a block path that is a link
    os.symlink(outside / "sub", f"{live[0].rank_dir}/abc")  # an <hhh> dir that is a link
    os.symlink(outside, f"{volume}/evil_0123456789ab_r0")  # a "rank dir" that is a link
    orphan = make_digest(volume, "acme/orphan", config_age=OLD)
    put_block(orphan[0], key(0), OLD, OLD)
    os.symlink(outside / "sub", f"{orphan[0].rank_dir}/def")
    os.makedirs(os.path.dirname(orphan[0].block_path(key(5))))
    os.symlink(target_file, orphan[0].block_path(key(5)))

    status, report = gc(
        volume,
        "--high",
        "off",
        "--max-bytes",
        "0",
        "--protect",
        "0",
        "--min-age",
        "1d",
        capsys=capsys,
    )
    assert status == 0, report
    assert target_file.read_bytes() == b"x" * 8192
    assert (outside / "sub" / "a.bin").read_bytes() == b"y" * 8192
    assert not os.path.exists(real)  # evicted
    assert os.path.islink(link_block) and os.path.islink(f"{live[0].rank_dir}/abc")
    assert os.path.islink(f"{volume}/evil_0123456789ab_r0")
    assert not os.path.exists(orphan[0].rank_dir)  # removed, its links unlinked, not followed
    assert report["symlink_count"] == 5


# -- dry run and leftovers -------------------------------------------------------------------


def test_dry_run_changes_nothing(volume, capsys):
    orphan = make_digest(volume, "acme/orphan", config_age=OLD)
    put_block(orphan[0], key(0), OLD, OLD)
    put_lease(orphan[0], dead_pid())
    live = make_digest(volume, "acme/live")
    for i in range(5):
        put_block(live[0], key(i), DAY)
    put_temp(live[0], key(9), dead_pid())
    os.makedirs(f"{live[0].rank_dir}/aaa/aa_g0")
    age(f"{live[0].rank_dir}/aaa/aa_g0", DAY)
    os.makedirs(f"{volume}/{TRASH_PREFIX}0123456789ab~1~2/x")
    before = snapshot(volume)

    status, report = gc(volume, "--dry-run", "--max-bytes", "0", "--protect", "0", capsys=capsys)
    assert status == 0
    assert snapshot(volume) == before
    assert report["dry_run"] and report["digests_removed"] == 1
    assert report["temps"]["removed"] == 1
    assert report["capacity"]["evicted_blocks"] == 5
    assert report["dirs_pruned"] == 2  # aaa/aa_g0, then aaa
    assert report["trash_removed"] == 1

    status, report = gc(volume, "--max-bytes", "0", "--protect", "0", capsys=capsys)
    assert status == 0
    assert report["trash_removed"] == 1
    assert not os.path.exists(orphan[0].base_path)
    assert cache_entries(live[0].rank_dir) == set()
    assert [n for n in os.listdir(volume) if n.startswith(".")] == [".llmkv-gc.lock"]


# -- safety details ------------------------------------------------------------------------


def test_a_tier_starting_during_removal_keeps_its_digest(volume, capsys, monkeypatch):
    """A lease written between gc's last check and its rename of the config
    directory: gc finds it in what it just moved aside and moves it back."""
    from llmkv_fs.ops.gc import actions

    layouts = make_digest(volume, "acme/restart", config_age=OLD)
    put_block(layouts[0], key(0), OLD, OLD)
    real_rename = os.rename

    def tier_starts_first(src, dst, **at):  # os.rename is patched for everyone: *_dir_fd too
        if src == layouts[0].base_path:
            put_lease(layouts[0], os.getpid())
        return real_rename(src, dst, **at)

    monkeypatch.setattr(actions.os, "rename", tier_starts_first)
    status, report = gc(volume, *QUIET, capsys=capsys)
    assert status == 0
    (entry,) = report["digests"]
    assert not entry["removed"] and "appeared" in entry["why"]
    assert present(digest_dirs(layouts)) == [True, True]
    assert os.listdir(f"{layouts[0].base_path}/leases")
    assert [n for n in os.listdir(volume) if n.startswith(TRASH_PREFIX)] == []


def test_pid_check_auto_in_a_kubernetes_pod(volume, capsys, monkeypatch):
    from llmkv_fs.ops.gc.rules import pids_are_ours

    layouts = make_digest(volume, "acme/pod", config_age=OLD)
    put_block(layouts[0], key(0), OLD, OLD)
    put_lease(layouts[0], dead_pid())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with open("/proc/1/comm", "rb") as f:
        shared_namespace = f.read().strip() == b"pause"
    assert pids_are_ours() is shared_namespace
    gc(volume, *QUIET, "--pid-check", "auto", capsys=capsys)
    # Without a shared process namespace "no such pid" proves nothing: the
    # fresh heartbeat keeps the digest.
    assert present(digest_dirs(layouts)) == [not shared_namespace] * 2
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert pids_are_ours()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--min-age", "7 weeks"], "is not a duration"),
        (["--max-bytes", "lots"], "is not a size"),
        (["--high", "120"], "between 0 and 100"),
        (["--high", "50", "--low", "60"], "is above --high"),
    ],
)
def test_bad_arguments_are_clear_errors(disk_root, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        gc(disk_root, *args)
    assert info.value.code not in (0, None)
    err = capsys.readouterr().err
    assert message in (err or str(info.value.code))
