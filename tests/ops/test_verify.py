"""``llmkv-fs verify`` on real block files written by the engine's BlockIO
(and, once, by vLLM's built-in tier): what it finds, what --repair moves,
and what it must leave alone (a republished file, a symlink's target,
atimes)."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import pytest
import xxhash

from llmkv_fs import cli
from llmkv_fs.engine import prepare_volume
from llmkv_fs.layout.blockfile import TRAILER_SIZE
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.ops import verify, verify_readers
from llmkv_fs.ops.progress import Progress
from llmkv_fs.volume import quarantine as quarantine_module
from tests.kits.engine_kit import BS, make_key, pattern, write_blocks
from tests.kits.volume_kit import quarantined

HEAD = 42  # trailer bytes before the key (see layout/blockfile.py)


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def make_future_version(path: str, key: bytes) -> None:
    """Rewrite the trailer as a (self-consistent) format version 3 one (2 is
    the sealed format, layout/sealed.py)."""
    with open(path, "r+b") as f:
        f.seek(BS)
        page = bytearray(f.read(TRAILER_SIZE))
        struct.pack_into("<H", page, 8, 3)
        key_end = HEAD + len(key)
        struct.pack_into("<Q", page, key_end, xxhash.xxh3_64_intdigest(bytes(page[:key_end])))
        f.seek(BS)
        f.write(page)


def run_cli(capsys, *argv) -> tuple[int, dict]:
    rc = cli.main(["verify", *argv, "--json", "--threads", "2"])
    return rc, json.loads(capsys.readouterr().out)


# -- a clean volume ------------------------------------------------------------------------------


def test_clean_volume_verifies(volume, capsys):
    layout, _ = write_blocks(volume, range(6))
    rc, report = run_cli(capsys, volume)
    assert rc == 0
    (d,) = report["digests"]
    assert d["name"] == os.path.basename(layout.base_path)
    assert (d["chunk_bytes"], d["chunk_source"], d["ranks"]) == (BS, "trailer", [0])
    assert (d["files"], d["verified"], d["unverified"], d["bad"], d["errors"]) == (6, 6, 0, 0, 0)
    assert report["totals"]["bytes_read"] == 6 * (BS + TRAILER_SIZE)
    assert report["bad"] == [] and report["errors"] == []
    assert report["files_per_s"] > 0 and report["bytes_per_s"] > 0


def test_human_output_and_exit_status(volume, capsys):
    layout, _ = write_blocks(volume, range(3))
    assert cli.main(["verify", volume]) == 0
    out = capsys.readouterr().out
    assert "verified 3" in out and "result: OK" in out
    os.truncate(layout.block_path(make_key(1)), 100)
    assert cli.main(["verify", volume]) == 1
    out = capsys.readouterr().out
    assert "truncated" in out and layout.block_path(make_key(1)) in out
    assert "result: 1 bad" in out


# -- every kind of bad file, and --repair -------------------------------------------------------


def plant_bad_files(layout: CacheLayout) -> dict[str, str]:
    """Corrupt some stored blocks and add bad and good odd ones. Returns
    {path: expected reason} of the bad ones."""
    bad = {}
    flip = layout.block_path(make_key(0))
    flip_byte(flip, 12345)  # same size, payload bit flip
    bad[flip] = "bad-checksum"
    short = layout.block_path(make_key(1))
    os.truncate(short, BS - 1000)
    bad[short] = "truncated"
    future = layout.block_path(make_key(2))
    make_future_version(future, make_key(2))
    bad[future] = "bad-version"
    # A valid block copied under another key's name.
    wrong = layout.block_path(make_key("not-stored"))
    os.makedirs(os.path.dirname(wrong), exist_ok=True)
    shutil.copyfile(layout.block_path(make_key(3)), wrong)
    bad[wrong] = "wrong-key"
    empty = layout.block_path(make_key("empty"))
    os.makedirs(os.path.dirname(empty), exist_ok=True)
    open(empty, "wb").close()
    bad[empty] = "truncated"
    long = layout.block_path(make_key(4))
    with open(long, "ab") as f:
        f.write(b"\0" * 10)
    bad[long] = "bad-length"
    stray = f"{layout.rank_dir}/{make_key(5).hex()[:-8]}.bin"  # not a block path
    shutil.copyfile(layout.block_path(make_key(5)), stray)
    bad[stray] = "bad-name"
    return bad


def write_trailerless(layout: CacheLayout, name) -> str:
    """A block as vLLM's built-in tier writes it: the payload, no trailer."""
    path = layout.block_path(make_key(name))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(pattern(name))
    return path


def test_finds_each_bad_file_and_repair_quarantines_exactly_those(volume, capsys):
    layout, _ = write_blocks(volume, range(10))
    bad = plant_bad_files(layout)
    builtin = write_trailerless(layout, "vllm-builtin")
    untouched = {layout.block_path(make_key(i)) for i in (3, *range(5, 10))} | {builtin}

    rc, report = run_cli(capsys, volume)
    assert rc == 1
    assert {b["path"]: b["reason"] for b in report["bad"]} == bad
    assert all(b["repair"] is None for b in report["bad"])
    t = report["totals"]
    assert (t["files"], t["bad"], t["unverified"], t["verified"]) == (14, 7, 1, 6)
    assert report["digests"][0]["chunk_bytes"] == BS
    assert quarantined(layout.rank_dir) == []  # no --repair: nothing moved
    assert all(os.path.lexists(p) for p in bad)

    rc, report = run_cli(capsys, volume, "--repair")
    assert rc == 1  # bad files were found (and moved)
    assert {b["repair"] for b in report["bad"]} == {"quarantined"}
    for b in report["bad"]:
        assert not os.path.lexists(b["path"])
        name = os.path.basename(b["quarantined_to"])
        assert name.startswith(os.path.basename(b["path"]) + f".{b['reason']}.")
        assert os.path.dirname(b["quarantined_to"]) == layout.quarantine_dir
    assert len(quarantined(layout.rank_dir)) == len(bad)
    assert all(os.path.exists(p) for p in untouched)

    rc, report = run_cli(capsys, volume)
    assert rc == 0
    assert (report["totals"]["verified"], report["totals"]["unverified"]) == (6, 1)


def test_trailerless_files_are_unverified_not_bad(volume, capsys):
    layout, _ = write_blocks(volume, [])
    for i in range(3):
        write_trailerless(layout, i)
    with open(layout.block_path(make_key(0)) + "_123.tmp", "wb") as f:  # vLLM mid-store
        f.write(b"partial")
    rc, report = run_cli(capsys, volume)
    assert rc == 0
    (d,) = report["digests"]
    assert (d["chunk_bytes"], d["chunk_source"]) == (BS, "trailer-less files")
    assert (d["files"], d["unverified"], d["verified"], d["bad"]) == (3, 3, 0, 0)


def test_blocks_written_by_vllm_builtin_tier(volume, capsys, replicas):
    pytest.importorskip("vllm")
    from tests.kits.tier_kit import Replica, builtin, make_keys, offloading_config, ours

    writer = Replica(offloading_config(tiers=[builtin(volume)]))
    replicas.append(writer)
    writer.store(make_keys(4, seed="vllm"))
    rc, report = run_cli(capsys, volume)
    assert rc == 0
    (d,) = report["digests"]
    assert (d["chunk_bytes"], d["chunk_source"]) == (writer.row_bytes, "trailer-less files")
    assert (d["unverified"], d["verified"], d["bad"]) == (4, 0, 0)

    ours_writer = Replica(offloading_config(tiers=[ours(volume)]))  # same digest
    replicas.append(ours_writer)
    ours_writer.store(make_keys(3, seed="ours"))
    rc, report = run_cli(capsys, volume)
    assert rc == 0
    (d,) = report["digests"]
    assert (d["chunk_bytes"], d["chunk_source"]) == (writer.row_bytes, "trailer")
    assert (d["unverified"], d["verified"], d["bad"]) == (4, 3, 0)


# -- safety: races, symlinks, atime ------------------------------------------------------------


def test_repair_leaves_a_file_republished_after_the_read(volume, capsys, monkeypatch):
    layout, _ = write_blocks(volume, range(3))
    path = layout.block_path(make_key(1))
    fresh = f"{os.path.dirname(path)}/.fresh"
    shutil.copyfile(path, fresh)  # what a concurrent store will publish
    flip_byte(path, 7)
    real_check = verify_readers.check_block

    def check_then_republish(rank_dir, p, lst, chunk, *rules):
        result = real_check(rank_dir, p, lst, chunk, *rules)
        if p == path:
            os.rename(fresh, path)  # a store lands between our read and repair
        return result

    monkeypatch.setattr(verify_readers, "check_block", check_then_republish)
    rc, report = run_cli(capsys, volume, "--repair")
    assert rc == 1
    (b,) = report["bad"]
    assert (b["path"], b["reason"], b["repair"]) == (path, "bad-checksum", "replaced")
    assert quarantined(layout.rank_dir) == []
    monkeypatch.undo()
    assert run_cli(capsys, volume)[0] == 0  # the republished block is good


def test_repair_puts_back_a_file_republished_just_before_the_rename(volume, capsys, monkeypatch):
    layout, _ = write_blocks(volume, range(3))
    path = layout.block_path(make_key(2))
    fresh = f"{os.path.dirname(path)}/.fresh"
    shutil.copyfile(path, fresh)
    os.truncate(path, 10)
    real_mkdir = quarantine_module.make_dir_at

    def republish_then_mkdir(*args, **kwargs):
        os.rename(fresh, path)  # lands after the inode check, before the rename
        return real_mkdir(*args, **kwargs)

    monkeypatch.setattr(quarantine_module, "make_dir_at", republish_then_mkdir)
    _rc, report = run_cli(capsys, volume, "--repair")
    (b,) = report["bad"]
    assert (b["reason"], b["repair"], b["quarantined_to"]) == ("truncated", "replaced", None)
    assert quarantined(layout.rank_dir) == []
    assert os.path.getsize(path) == BS + TRAILER_SIZE
    monkeypatch.undo()
    assert run_cli(capsys, volume)[0] == 0


def test_symlink_and_fifo_are_never_followed_or_opened(volume, capsys, tmp_path):
    layout, _ = write_blocks(volume, range(2))
    # A good block outside the volume, linked in under its own key's path:
    # following the link would make it verify.
    (tmp_path / "other").mkdir()
    outside = write_blocks(str(tmp_path / "other"), [7])[0].block_path(make_key(7))
    link = layout.block_path(make_key(7))
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(outside, link)
    fifo = layout.block_path(make_key(8))
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.mkfifo(fifo)  # opening it for reading without O_NONBLOCK would hang
    before = os.stat(outside)

    rc, report = run_cli(capsys, volume, "--repair")
    assert rc == 1
    assert {b["path"]: (b["reason"], b["repair"]) for b in report["bad"]} == {
        link: ("symlink", "quarantined"),
        fifo: ("not-regular", "quarantined"),
    }
    assert report["totals"]["verified"] == 2
    assert report["totals"]["bytes_read"] == 2 * (BS + TRAILER_SIZE)
    after = os.stat(outside)  # the target is where it was, unread and unmoved
    assert (after.st_ino, after.st_size, after.st_atime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_atime_ns,
    )
    moved = quarantined(layout.rank_dir)
    assert sorted(os.path.islink(m) for m in moved) == [False, True]


def test_reading_does_not_refresh_last_used(volume, capsys):
    layout, _ = write_blocks(volume, range(2))
    path = layout.block_path(make_key(0))
    old = time.time() - 3 * 86400
    # atime older than a day and newer than mtime: relatime would bump it.
    os.utime(path, (old + 3600, old))
    before = os.stat(path)
    assert run_cli(capsys, volume)[1]["totals"]["atime_touched"] == 0
    assert os.stat(path).st_atime_ns == before.st_atime_ns


# -- selection, progress, import -----------------------------------------------------------------


def test_digest_filter(volume, capsys):
    layout, _ = write_blocks(volume, range(2))
    other = CacheLayout(volume, {**layout.run_config, "dtype": "float16"}, 0)
    prepare_volume(other)
    os.makedirs(f"{other.rank_dir}/abc", exist_ok=True)
    rc, report = run_cli(capsys, volume, "--digest", layout.digest)
    assert rc == 0 and [d["name"] for d in report["digests"]] == [layout.digest_dir_name]
    assert cli.main(["verify", volume, "--digest", "nope"]) == 2
    assert "no digest 'nope'" in capsys.readouterr().err
    assert cli.main(["verify", f"{volume}/missing"]) == 2


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_only_on_a_terminal(volume, capsys):
    write_blocks(volume, range(4))
    tty = FakeTty()
    verify.verify_volume(volume, threads=2, progress_stream=tty)
    progress = Progress("verify", tty, total=4, unit=" files")
    progress.update("bad 0", 4, force=True)
    text = tty.getvalue()
    assert "\rverify: " in text and "| 4/4 [" in text and "files/s" in text
    pipe = io.StringIO()
    verify.verify_volume(volume, threads=2, progress_stream=pipe)
    assert pipe.getvalue() == ""
    assert cli.main(["verify", volume]) == 0
    assert capsys.readouterr().err == ""  # pytest's stderr is not a TTY


def test_ops_tools_import_without_vllm_or_torch(tmp_path):
    code = (
        "import sys\n"
        "from llmkv_fs import cli\n"
        "from llmkv_fs.ops import stats, verify\n"
        "cli.build_parser()\n"
        f"assert cli.main(['verify', {str(tmp_path)!r}, '--json']) == 0\n"
        f"assert cli.main(['stats', {str(tmp_path)!r}, '--json']) == 0\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
