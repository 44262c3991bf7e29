"""One bad entry costs that entry (issue 21): gc, stats and verify finish
every pass with their full report whatever one directory or file below the
root does -- a tree deeper than PATH_MAX, a directory swapped for a symlink
or a file, one that vanishes, one the tool may not read (EACCES, as a real
other user), a disk that answers EIO (a real shut-down ext4 mounted inside
the tree), an NFS handle gone stale. What could not be read or done is
reported with a count per kind and example paths, and skipped."""

from __future__ import annotations

import json
import os
import select

import pytest

from llmkv_fs.cli import main as cli_main
from tests.kits.gc_kit import (
    DAY,
    age,
    block_bytes,
    gc,
    gc_process,
    key,
    make_digest,
    put_block,
    running,
    stop_watch,
)
from tests.kits.ops_fault_kit import (
    EIO,
    ESTALE,
    LOCAL_FILESYSTEMS,
    DirFault,
    chown_tree,
    deep_chain,
    depth_of_chain,
    local_dir,
    moved_aside,
    nested_ext4,
    raise_errno,
    reachable_root,
    remove_chain,
    shut_down_ext4,
    swap_for_file,
    swap_for_symlink,
    tool,
    vanish,
)
from tests.kits.user_kit import tool_as

OLD = 8 * DAY
EVICT_ALL = ("--high", "off", "--max-bytes", "0", "--protect", "0")
N_BLOCKS = 6


def cache_with_blocks(root: str, n: int = N_BLOCKS, seed: str = "b"):
    """A live-looking digest (fresh config.json) with ``n`` old blocks."""
    (layout,) = make_digest(root, "acme/bad")
    return layout, [put_block(layout, key(i, seed), OLD, OLD) for i in range(n)]


def fan_out_dirs(blocks: list[str]) -> set[str]:
    return {os.path.dirname(b) for b in blocks} | {
        os.path.dirname(os.path.dirname(b)) for b in blocks
    }


@pytest.fixture(params=LOCAL_FILESYSTEMS)
def local_root(request, tmp_path):
    yield from local_dir(request.param, tmp_path)


# -- a tree deeper than PATH_MAX -----------------------------------------------------------------


def test_a_tree_deeper_than_path_max_costs_nothing(local_root, capsys):
    volume = local_root
    layout, blocks = cache_with_blocks(volume)
    old_empty = f"{layout.rank_dir}/fff/ff_g0"
    os.makedirs(old_empty)
    for path in (old_empty, os.path.dirname(old_empty)):
        age(path, OLD)
    deepest = deep_chain(layout.rank_dir, leaf_file="notes.txt")
    try:
        status, stats = tool(capsys, "stats", volume)
        assert status == 0
        (digest,) = stats["digests"]
        assert digest["blocks"] == N_BLOCKS and digest["unreadable_dirs"] == []
        assert digest["other"]["entries"] == [{"path": f"{deepest}/notes.txt", "type": "file"}]
        assert stats["problems"] == {} and stats["totals"]["problems"] == 0

        status, verified = tool(capsys, "verify", volume)
        assert status == 0, verified
        assert verified["totals"]["verified"] == N_BLOCKS
        assert verified["errors"] == [] and verified["problems"] == {}

        status, report = gc(volume, *EVICT_ALL, capsys=capsys)
        assert status == 0, report
        assert report["capacity"]["evicted_blocks"] == N_BLOCKS
        assert not any(os.path.exists(b) for b in blocks)
        assert report["dirs_pruned"] == len(
            fan_out_dirs(blocks) | {old_empty, f"{layout.rank_dir}/fff"}
        )
        assert report["problems"] == {} and report["error_count"] == 0
        assert depth_of_chain(layout.rank_dir) == 20  # it holds a file: kept
    finally:
        remove_chain(layout.rank_dir)


def test_a_block_name_below_path_max_is_reported_and_quarantined(local_root, capsys):
    volume = local_root
    layout, blocks = cache_with_blocks(volume)
    stray = f"{'ab' * 32}.bin"
    deepest = deep_chain(layout.rank_dir, leaf_file=stray)
    try:
        status, verified = tool(capsys, "verify", volume, "--repair")
        assert status == 1
        assert verified["totals"]["verified"] == N_BLOCKS
        (bad,) = verified["bad"]
        assert (bad["path"], bad["reason"]) == (f"{deepest}/{stray}", "bad-name")
        # Moved aside through directory descriptors, one level at a time:
        # the path's length does not matter.
        assert bad["repair"] == "quarantined" and verified["problems"] == {}
        assert os.path.basename(bad["quarantined_to"]).startswith(f"{stray}.bad-name.")
        assert not os.path.lexists(f"{deepest}/{stray}")
        assert cli_main(["verify", volume, "--repair"]) == 0
        capsys.readouterr()

        # gc reaches the chain through directory fds: its empty levels pruned.
        status, report = gc(volume, *EVICT_ALL, capsys=capsys)
        assert status == 0, report
        assert report["capacity"]["evicted_blocks"] == N_BLOCKS
        assert depth_of_chain(layout.rank_dir) == 0
        assert report["dirs_pruned"] == len(fan_out_dirs(blocks)) + 20
    finally:
        remove_chain(layout.rank_dir)


def read_line(stream, deadline_s: float = 60.0) -> str:
    ready, _, _ = select.select([stream], [], [], deadline_s)
    assert ready, f"no output within {deadline_s}s"
    return stream.readline()


def test_watch_passes_report_and_prune_past_a_deep_tree(disk_root):
    layout, blocks = cache_with_blocks(disk_root)
    deep_chain(layout.rank_dir, leaf_file="notes.txt")
    try:
        with running(
            gc_process(disk_root, "--watch", "1h", "--json", "--pid-check", "on", *EVICT_ALL)
        ) as watcher:
            first = json.loads(read_line(watcher.stdout))
            assert stop_watch(watcher) == []
        assert first["capacity"]["evicted_blocks"] == N_BLOCKS
        assert first["dirs_pruned"] == len(fan_out_dirs(blocks))
        assert first["error_count"] == 0
    finally:
        remove_chain(layout.rank_dir)


# -- one directory goes bad while a tool reads the tree ------------------------------------------

FAULTS = {
    # name: (what happens to the directory, the problem kind reported or None)
    "symlink-swapped-in": ("symlink", "ELOOP"),
    "file-swapped-in": ("file", "ENOTDIR"),
    "vanished": ("vanish", None),
    "estale": ("estale", "ESTALE"),
    "eio": ("eio", "EIO"),
}


def _act(name: str, outside: str):
    return {
        "symlink": swap_for_symlink(outside),
        "file": swap_for_file,
        "vanish": vanish,
        "estale": raise_errno(ESTALE),
        "eio": raise_errno(EIO),
    }[name]


def outside_blocks(where) -> dict[str, tuple]:
    """A directory outside the root with a valid and a corrupt block file:
    what a followed link would reach. Returns its state (to compare)."""
    where.mkdir()
    good = key(0, "outside")
    (where / f"{good[:-4].hex()}.bin").write_bytes(block_bytes(good))
    (where / f"{key(1, 'outside')[:-4].hex()}.bin").write_bytes(b"\0" * 100)
    for path in where.iterdir():
        age(str(path), OLD, OLD)
    return tree_state(str(where))


def tree_state(root: str) -> dict[str, tuple]:
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(directory, name))
            out[os.path.relpath(os.path.join(directory, name), root)] = (
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
                st.st_atime_ns,
            )
    return out


@pytest.mark.parametrize("tool_name", ["gc", "stats", "verify"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_one_directory_going_bad_costs_that_directory(
    local_root, tmp_path, capsys, monkeypatch, fault, tool_name
):
    root = local_root
    layout, blocks = cache_with_blocks(root)
    # A sibling of the bad directory under the same <hhh>: read all the same.
    blocks.append(put_block(layout, key(0, "b", group=1), OLD, OLD))
    target = os.path.dirname(blocks[0])
    lost = [b for b in blocks if os.path.dirname(b) == target]
    kept = [b for b in blocks if b not in lost]
    outside = outside_blocks(tmp_path / "outside")
    act, kind = FAULTS[fault]
    DirFault(monkeypatch, target, _act(act, str(tmp_path / "outside")))

    if tool_name == "gc":
        status, report = gc(root, *EVICT_ALL, capsys=capsys)
        assert report["capacity"]["evicted_blocks"] == len(kept), report
        assert not any(os.path.exists(b) for b in kept)
        problems = report["problems"]
        assert report["error_count"] == (1 if kind else 0)
    elif tool_name == "stats":
        status, report = tool(capsys, "stats", root)
        assert report["digests"][0]["blocks"] == len(kept)
        problems = report["problems"]
    else:
        status, report = tool(capsys, "verify", root, "--repair")
        assert report["totals"]["verified"] == len(kept)
        assert report["bad"] == []
        problems = report["problems"]
    monkeypatch.undo()

    expected_status = {"gc": 1, "stats": 0, "verify": 1}[tool_name] if kind else 0
    assert status == expected_status, report
    if kind is None:
        assert problems == {}
    else:
        assert list(problems) == [kind]
        assert problems[kind]["count"] == 1
        assert problems[kind]["examples"][0]["path"] == target
    # Nothing outside the root was read, moved or removed through a link.
    assert tree_state(str(tmp_path / "outside")) == outside
    if act in ("symlink", "file", "vanish"):
        assert sorted(os.listdir(moved_aside(target))) == sorted(os.path.basename(b) for b in lost)


@pytest.mark.parametrize("tool_name", ["gc", "stats", "verify"])
def test_a_file_vanishing_between_listing_and_lstat(local_root, capsys, monkeypatch, tool_name):
    layout, blocks = cache_with_blocks(local_root)
    blocks.append(put_block(layout, key(0, "b", group=1), OLD, OLD))
    target = os.path.dirname(blocks[0])
    DirFault(monkeypatch, target, lambda _path: os.unlink(blocks[0]), after_listing=True)
    if tool_name == "gc":
        status, report = gc(local_root, *EVICT_ALL, capsys=capsys)
        assert report["capacity"]["evicted_blocks"] == len(blocks) - 1
    elif tool_name == "stats":
        status, report = tool(capsys, "stats", local_root)
        assert report["digests"][0]["blocks"] == len(blocks) - 1
    else:
        status, report = tool(capsys, "verify", local_root)
        assert report["totals"]["verified"] == len(blocks) - 1
    monkeypatch.undo()
    assert status == 0 and report["problems"] == {}, report


# -- real errors from the kernel: EACCES as another user, EIO from a failed disk -----------------


def nobody() -> tuple[int, int]:
    import pwd

    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


@pytest.mark.parametrize("base", ["/tmp", "/dev/shm"], ids=["disk", "tmpfs"])
def test_what_the_user_may_not_read_is_reported_and_skipped(base):
    uid, gid = nobody()
    with reachable_root(base) as root:
        layout, blocks = cache_with_blocks(root)
        # <hhh> the user may not list, and <hh>_g0 it may list but not
        # search (each entry's lstat is EACCES), beside a readable <hh>_g1.
        unlistable = os.path.dirname(os.path.dirname(blocks[0]))
        unsearchable_block = put_block(layout, key(0, "search"), OLD, OLD)
        unsearchable = os.path.dirname(unsearchable_block)
        sibling = put_block(layout, key(0, "search", group=1), OLD, OLD)
        readable = [b for b in [*blocks[1:], sibling] if not b.startswith(unlistable + "/")]
        chown_tree(root, uid, gid)
        os.chmod(unlistable, 0)
        os.chmod(unsearchable, 0o644)

        status, out, err = tool_as(uid, gid, ["stats", root, "--json"])
        assert status == 0, err
        stats = json.loads(out)
        assert stats["digests"][0]["blocks"] == len(readable)
        assert stats["problems"]["EACCES"]["count"] == 2
        assert {e["path"] for e in stats["problems"]["EACCES"]["examples"]} == {
            unlistable,
            unsearchable_block,
        }

        status, out, err = tool_as(uid, gid, ["verify", root, "--json"])
        assert status == 1, err
        verified = json.loads(out)
        assert verified["totals"]["verified"] == len(readable)
        assert {(e["path"], e["reason"]) for e in verified["errors"]} == {
            (unlistable, "list-error"),
            (unsearchable_block, "stat-error"),
        }

        status, out, err = tool_as(
            uid, gid, ["gc", root, "--json", "--pid-check", "on", *EVICT_ALL]
        )
        assert status == 1, err
        report = json.loads(out)
        assert report["capacity"]["evicted_blocks"] == len(readable)
        assert not any(os.path.exists(b) for b in readable)
        assert report["problems"]["EACCES"]["count"] == 2
        assert os.path.exists(unsearchable_block)

        status, out, err = tool_as(uid, gid, ["gc", root, *EVICT_ALL])
        assert status == 1, err
        assert "EACCES: 2" in out and f"list {unlistable}: Permission denied" in out


def test_a_disk_answering_eio_below_a_rank_dir(disk_root, tmp_path, capsys):
    layout, blocks = cache_with_blocks(disk_root)
    failing = key(0, "eio")
    hhh = f"{layout.rank_dir}/{failing[:-4].hex()[:3]}"
    os.makedirs(hhh)
    with nested_ext4(hhh, str(tmp_path / "eio.img")):
        os.rmdir(f"{hhh}/lost+found")  # an empty directory gc would prune
        broken = [put_block(layout, failing, OLD, OLD)]
        broken.append(put_block(layout, key(0, "eio", group=1), OLD, OLD))
        shut_down_ext4(hhh)

        status, verified = tool(capsys, "verify", disk_root)
        assert status == 1
        assert verified["totals"]["verified"] == N_BLOCKS
        assert verified["problems"]["EIO"]["count"] == 2
        assert {e["path"] for e in verified["errors"]} == set(broken)

        status, report = gc(disk_root, *EVICT_ALL, capsys=capsys)
        assert status == 1
        assert report["capacity"]["evicted_blocks"] == N_BLOCKS
        assert not any(os.path.exists(b) for b in blocks)
        eio = report["problems"]["EIO"]
        assert eio["count"] == 2 and {e["op"] for e in eio["examples"]} == {"unlink"}
        assert report["dirs_pruned"] == len(fan_out_dirs(blocks))

        assert cli_main(["gc", disk_root, "--pid-check", "on", *EVICT_ALL]) == 1
        text = capsys.readouterr().out
        assert "EIO: 2" in text and f"unlink {broken[0]}: Input/output error" in text


def test_a_root_gc_cannot_list_still_gets_a_report():
    """Only the root failing ends a pass early; even then it reports."""
    uid, gid = nobody()
    with reachable_root("/tmp") as root:
        os.chmod(root, 0o733)  # the lock file can be made, the root not listed
        status, out, err = tool_as(uid, gid, ["gc", root, "--json"])
        assert status == 1
        report = json.loads(out)
        assert report["aborted"] == f"{root}: Permission denied"
        assert report["problems"]["EACCES"]["examples"] == [
            {"op": "pass", "path": root, "detail": "Permission denied"}
        ]
        assert "pass stopped early" in err
