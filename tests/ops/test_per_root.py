"""``llmkv-fs gc|stats|verify`` over several roots (issue 19): a tier sharded
with ``path_sharding: by_block_hash`` keeps an ordinary cache on each root,
and the tools handle each root on its own -- its own report, gc's own lock
and capacity limits per root -- then add up. Real files on two real tmpfs
mounts (two volumes), written by the gc tests' helpers."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from llmkv_fs.cli import main as cli_main
from llmkv_fs.layout.blockfile import TRAILER_SIZE
from llmkv_fs.layout.names import gc_lock_path
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.ops.gc import EXIT_BUSY
from llmkv_fs.ops.per_root import parse_roots, worst
from llmkv_fs.rootlist import RootListError
from tests.kits.gc_kit import (
    DAY,
    PAYLOAD,
    gc,
    gc_process,
    identity,
    key,
    lock_held,
    make_digest,
    put_block,
    put_lease,
    read_line,
    running,
    snapshot,
    stop_watch,
)

OLD = 8 * DAY
BLOCK_FILE = PAYLOAD + TRAILER_SIZE
N_A, N_B = 5, 3  # live blocks on root a, on root b


@pytest.fixture
def roots(mount_tmpfs):
    """Two roots on two separate tmpfs volumes of different sizes, each an
    ordinary cache: a live digest (a lease of this process) with N_A / N_B
    blocks stored a day ago, and an orphaned digest of 2 old blocks."""
    a = os.path.join(mount_tmpfs("16m"), "kv")
    b = os.path.join(mount_tmpfs("32m"), "kv")
    for root, n in ((a, N_A), (b, N_B)):
        os.mkdir(root)
        live = make_digest(root, "acme/live")
        put_lease(live[0], os.getpid())
        for i in range(n):
            put_block(live[0], key(i, root), DAY, DAY)
        orphan = make_digest(root, "acme/orphan", config_age=OLD)
        for i in range(2):
            put_block(orphan[0], key(i, "orphan" + root), OLD, OLD)
    return a, b


def run_json(capsys, tool: str, *argv: str) -> tuple[int, dict]:
    status, report, _ = run_json_err(capsys, tool, *argv)
    return status, report


def run_json_err(capsys, tool: str, *argv: str) -> tuple[int, dict, str]:
    """The tool in this process with --json: (status, report, stderr)."""
    extra = ("--pid-check", "on") if tool == "gc" else ()
    status = cli_main([tool, *argv, "--json", *extra])
    out, err = capsys.readouterr()
    return status, json.loads(out) if out.strip() else {}, err


def orphan_dir(root: str) -> str:
    return CacheLayout.for_identity(root, identity("acme/orphan")).base_path


# -- each root reported on its own, and in all -------------------------------------------


def test_stats_reports_each_root_and_the_total(roots, capsys):
    a, b = roots
    status, report = run_json(capsys, "stats", a, b)
    assert status == 0
    assert [r["root"] for r in report["roots"]] == [a, b]
    assert [r["status"] for r in report["roots"]] == [0, 0]
    per_root = [r["totals"] for r in report["roots"]]
    assert [t["blocks"] for t in per_root] == [N_A + 2, N_B + 2]
    assert [t["bytes"] for t in per_root] == [(N_A + 2) * BLOCK_FILE, (N_B + 2) * BLOCK_FILE]
    assert report["totals"]["blocks"] == N_A + N_B + 4
    assert report["totals"]["bytes"] == (N_A + N_B + 4) * BLOCK_FILE
    assert report["totals"]["digests"] == 4
    # Each root is read on its own volume: its own statvfs.
    sizes = [r["filesystem"]["size_bytes"] for r in report["roots"]]
    assert sizes == [16 << 20, 32 << 20]

    assert cli_main(["stats", a, b]) == 0
    text = capsys.readouterr().out
    assert f"== root 1 of 2: {a} ==\nvolume {a}\n" in text
    assert f"== root 2 of 2: {b} ==\nvolume {b}\n" in text
    assert "== all 2 roots ==" in text
    summary = text.split("== all 2 roots ==\n")[1].splitlines()
    assert summary[0].split() == ["ROOT", "DIGESTS", "BLOCKS", "BYTES", "TEMP", "QUAR", "PROBLEMS"]
    assert summary[1].split()[:3] == [a, "2", str(N_A + 2)]
    assert summary[2].split()[:3] == [b, "2", str(N_B + 2)]
    total_row = summary[3]
    assert total_row.split()[1:3] == ["4", str(N_A + N_B + 4)]


def test_single_root_output_is_unchanged(roots, capsys):
    a, _ = roots
    status, report = run_json(capsys, "stats", a)
    assert status == 0
    assert "roots" not in report and report["root"] == a
    assert report["totals"]["blocks"] == N_A + 2
    assert cli_main(["stats", a]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"volume {a}\n") and "==" not in text


def test_verify_reports_each_root_and_the_worst_status(roots, capsys):
    a, b = roots
    bad = put_block(make_digest(b, "acme/live")[0], key(99, b), DAY, DAY)
    with open(bad, "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xfe")
    status, report = run_json(capsys, "verify", a, b)
    assert status == 1
    assert [r["status"] for r in report["roots"]] == [0, 1]
    assert [r["totals"]["verified"] for r in report["roots"]] == [N_A + 2, N_B + 2]
    assert [len(r["bad"]) for r in report["roots"]] == [0, 1]
    assert report["roots"][1]["bad"][0]["path"] == bad
    assert report["totals"]["verified"] == N_A + N_B + 4 and report["totals"]["bad"] == 1

    assert cli_main(["verify", f"{a},{b}"]) == 1
    text = capsys.readouterr().out
    assert text.index(f"== root 1 of 2: {a} ==") < text.index(f"== root 2 of 2: {b} ==")
    assert "result: 1 bad, 0 unreadable" in text.split("== all 2 roots ==")[1]
    assert f"{a}: ok" in text and f"{b}: exit status 1" in text


def test_gc_collects_each_root_and_capacity_limits_are_per_root(roots, capsys):
    a, b = roots
    # The cache on b (its blocks, both config.json, the lease) as gc counts it.
    _, alone = gc(b, "--dry-run", "--high", "off", capsys=capsys)
    limit = alone["capacity"]["cache_bytes"] - 2 * BLOCK_FILE  # b minus its orphan
    status, report = run_json(
        capsys, "gc", a, b, "--high", "off", "--max-bytes", str(limit), "--protect", "0"
    )
    assert status == 0, report
    by_root = {r["root"]: r for r in report["roots"]}
    for root in (a, b):
        assert by_root[root]["digests_removed"] == 1
        assert not os.path.exists(orphan_dir(root))
        assert os.path.exists(gc_lock_path(root))  # each root's own lock
    # --max-bytes holds on each root: b is at it once its orphan is gone,
    # a holds N_A - N_B blocks more (a limit over both roots together would
    # have evicted about N_A blocks, from both).
    assert by_root[b]["capacity"]["evicted_blocks"] == 0
    assert by_root[a]["capacity"]["evicted_blocks"] == N_A - N_B
    assert report["totals"]["digests_removed"] == 2
    assert report["totals"]["evicted_blocks"] == N_A - N_B
    freed = sum(r["bytes_freed"] for r in report["roots"])
    assert report["totals"]["bytes_freed"] == freed > 0
    left = [
        sum(
            os.path.exists(make_digest(root, "acme/live")[0].block_path(key(i, root)))
            for i in range(N_A)
        )
        for root in (a, b)
    ]
    assert left == [N_B, N_B]


def test_gc_text_has_a_section_per_root_and_a_total(roots, capsys):
    a, b = roots
    assert cli_main(["gc", a, b, "--high", "off", "--pid-check", "on"]) == 0
    text = capsys.readouterr().out
    first, second = text.split(f"== root 2 of 2: {b} ==")
    assert first.startswith(f"== root 1 of 2: {a} ==\nllmkv-fs gc {a}\n")
    assert f"removed      {os.path.basename(orphan_dir(a))}" in first
    assert second.startswith(f"\nllmkv-fs gc {b}\n")
    total = second.split("== all 2 roots ==")[1]
    assert "removed on 2 of 2 roots: 2 digests" in total
    assert "exit status 0" in total


# -- one list or several arguments ------------------------------------------------------


def essentials(tool: str, report: dict) -> list:
    """What a run found on each root, without its timings."""
    out = []
    for r in report["roots"]:
        if tool == "gc":
            digests = [(d["name"], d["removed"], d["bytes"]) for d in r["digests"]]
            out.append((r["root"], r["status"], digests, r["capacity"]["evicted_blocks"]))
        else:
            names = [
                (d["name"], d["blocks"] if tool == "stats" else d["verified"]) for d in r["digests"]
            ]
            out.append((r["root"], r["status"], names, r["totals"]))
    return out


@pytest.mark.parametrize("tool", ["stats", "verify", "gc"])
def test_a_comma_list_and_several_arguments_are_the_same(roots, capsys, tool):
    a, b = roots
    extra = ("--dry-run", "--high", "off", "--max-bytes", "0", "--protect", "0")
    extra = extra if tool == "gc" else ()
    before = [snapshot(a), snapshot(b)]
    status_args, as_args = run_json(capsys, tool, a, b, *extra)
    status_list, as_list = run_json(capsys, tool, f"{a},{b}", *extra)
    status_spaced, as_spaced = run_json(capsys, tool, f" {a} , {b} ", *extra)
    assert status_args == status_list == status_spaced == 0
    assert essentials(tool, as_args) == essentials(tool, as_list) == essentials(tool, as_spaced)
    assert [r["root"] for r in as_list["roots"]] == [a, b]
    if tool == "gc":  # the dry run would have removed something, and did not
        assert as_list["totals"]["digests_removed"] == 2
        assert as_list["totals"]["evicted_blocks"] == N_A + N_B
    assert [snapshot(a), snapshot(b)] == before


# -- bad lists: exit 2, the entry named, nothing touched -------------------------------------


def bad_lists(a: str, b: str, tmp: str) -> dict[str, tuple[list[str], str]]:
    link = os.path.join(tmp, "link-to-a")
    os.symlink(a, link)
    return {
        "symlink": ([f"{a},{link}"], f"entry 2 {link!r} and entry 1 {a!r} are the same directory"),
        "symlink-args": ([a, b, link], f"entry 3 {link!r} and entry 1 {a!r}"),
        "nested": ([f"{a},{b},{a}/inner"], f"entry 3 '{a}/inner' lies inside entry 1 {a!r}"),
        "nested-link": ([a, f"{link}/inner"], f"entry 2 '{link}/inner' lies inside entry 1 {a!r}"),
        "empty": ([f"{a},,{b}"], "entry 2 is empty"),
        "trailing-comma": ([f"{a},{b},"], "entry 3 is empty"),
        "empty-arg": ([a, "", b], "entry 2 is empty"),
        "spelled-twice": ([a, f"{a}/"], f"entry 2 '{a}/' names the same directory as entry 1"),
    }


@pytest.mark.parametrize("tool", ["gc", "stats", "verify"])
def test_a_bad_list_is_refused_naming_the_entry_and_touches_nothing(roots, tmp_path, capsys, tool):
    a, b = roots
    if tool == "verify":  # --repair would move this bad block
        bad = put_block(make_digest(a, "acme/live")[0], key(77, a), DAY, DAY)
        with open(bad, "r+b") as f:
            f.write(b"\0\0")
    evict_all = ("--high", "off", "--max-bytes", "0", "--protect", "0", "--pid-check", "on")
    extra = {"gc": evict_all, "stats": (), "verify": ("--repair",)}[tool]
    for case, (argv, named) in bad_lists(a, b, str(tmp_path)).items():
        before = [snapshot(a), snapshot(b)]
        status = cli_main([tool, *argv, *extra])
        out, err = capsys.readouterr()
        assert status == 2, case
        assert out == "", case
        assert err.startswith(f"llmkv-fs {tool}: roots"), (case, err)
        assert named in err, (case, err)
        assert [snapshot(a), snapshot(b)] == before, case
        assert not os.path.exists(f"{a}/inner"), case
        assert not os.path.exists(gc_lock_path(a)) and not os.path.exists(gc_lock_path(b)), case


def test_a_directory_with_a_comma_in_its_name_is_one_root(tmp_path, capsys, monkeypatch):
    odd = tmp_path / "kv,1"
    odd.mkdir()
    make_digest(str(odd), "acme/odd")
    status, report = run_json(capsys, "stats", str(odd))
    assert status == 0
    assert report["root"] == str(odd) and report["totals"]["digests"] == 1
    # Ambiguous: the whole is a directory, and so is each entry.
    (tmp_path / "p,q").mkdir()
    (tmp_path / "p,").mkdir()
    (tmp_path / "p").mkdir()
    (tmp_path / "q").mkdir()
    monkeypatch.chdir(tmp_path)  # entries are relative to the current directory
    with pytest.raises(RootListError, match="one root or a list"):
        parse_roots(["p,q"])
    assert parse_roots(["p,"]) == ("p,",)  # a directory, its entries are not: that one root
    assert cli_main(["stats", "p,q"]) == 2
    assert "one root or a list" in capsys.readouterr().err


# -- one root missing or busy: the others still done ------------------------------------------


@pytest.mark.parametrize("tool", ["gc", "stats", "verify"])
def test_a_missing_root_fails_but_the_other_is_still_done(roots, capsys, tool):
    a, b = roots
    missing = os.path.join(os.path.dirname(b), "gone", "kv")
    extra = ("--high", "off") if tool == "gc" else ()
    status, report, err = run_json_err(capsys, tool, missing, a, *extra)
    assert status == 2 and missing in err
    gone, done = report["roots"]
    assert gone == {"root": missing, "status": 2, "error": gone["error"]}
    assert "not a directory" in gone["error"]
    assert done["root"] == a and done["status"] == 0
    if tool == "gc":
        assert done["digests_removed"] == 1 and not os.path.exists(orphan_dir(a))
    else:
        assert done["totals"]["verified" if tool == "verify" else "blocks"] == N_A + 2
    assert not os.path.exists(os.path.dirname(missing))  # nothing created
    # Text: both sections, the failure said on stderr and in the summary.
    assert cli_main([tool, a, missing, *extra]) == 2
    out, err = capsys.readouterr()
    assert f"== root 2 of 2: {missing} ==\nnot done: " in out
    assert f"{missing}: exit status 2" in out
    assert missing in err


def test_gc_lock_held_on_one_root_the_other_is_still_collected(roots, capsys):
    a, b = roots
    with lock_held(b) as holder:
        status, report, err = run_json_err(capsys, "gc", a, b, "--high", "off")
    assert status == EXIT_BUSY
    done, busy = report["roots"]
    assert done["root"] == a and done["status"] == 0 and done["digests_removed"] == 1
    assert not os.path.exists(orphan_dir(a))
    assert busy["root"] == b and busy["status"] == EXIT_BUSY
    assert "another gc holds" in busy["error"] and f"pid={holder.pid}" in busy["error"]
    assert os.path.exists(orphan_dir(b))  # untouched: its lock was held
    assert f"another gc holds {gc_lock_path(b)}" in err
    assert report["status"] == EXIT_BUSY


def test_watch_prints_one_line_per_pass_over_all_roots(roots):
    a, b = roots
    watcher = gc_process(
        f"{a},{b}",
        "--watch",
        "1h",
        "--json",
        "--high",
        "off",
        "--pid-check",
        "on",
        stdin=subprocess.DEVNULL,
    )
    with running(watcher):
        line = json.loads(read_line(watcher.stdout))
        rest = stop_watch(watcher)
    assert [r["root"] for r in line["roots"]] == [a, b]
    assert [r["digests_removed"] for r in line["roots"]] == [1, 1]
    assert line["status"] == 0 and rest == []


def test_worst_status():
    assert worst([]) == 0
    assert worst([0, 0]) == 0
    assert worst([0, EXIT_BUSY]) == EXIT_BUSY
    assert worst([EXIT_BUSY, 1, 0]) == 1
    assert worst([1, 2, EXIT_BUSY]) == 2
    assert worst([2, 143, 0]) == 143
