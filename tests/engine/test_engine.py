"""FsEngine's block I/O without vLLM: round trips on tmpfs and ext4, I/O mode
choice, verification and quarantine, trailer-less files, lookups, import
isolation."""

from __future__ import annotations

import logging
import mmap
import os
import subprocess
import sys

import pytest

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import (
    Direction,
    EngineError,
    Failure,
    FsEngine,
    Outcome,
    Tally,
    prepare_volume,
)
from llmkv_fs.layout.blockfile import TRAILER_SIZE, Corruption, unpack_trailer
from llmkv_fs.layout.paths import CacheLayout
from tests.kits.engine_kit import (
    BS,
    IDENTITY,
    fill,
    inside,
    make_key,
    pattern,
    replace_checks,
    row,
    settle,
    store_blocks,
    wait_jobs,
)

# -- round trip ---------------------------------------------------------------------------


def test_store_then_load_round_trip(volume, engines):
    engine, layout, primary = engines(volume, n_blocks=16)
    ids = list(range(6))
    keys = [make_key(i) for i in ids]
    for chunk, i in enumerate(ids):
        fill(primary, chunk, pattern(i))
    assert engine.submit_store(1, keys, list(range(6)))
    stored = wait_jobs(engine, [1])[1]
    assert stored.success and not stored.is_load
    assert sorted(stored.succeeded) == sorted(keys) and stored.failed == []
    assert stored.nbytes == 6 * BS
    assert engine.counters[Outcome.WRITTEN] == 6
    assert engine.counters[Tally.BYTES_WRITTEN] == 6 * BS
    for key in keys:
        assert os.path.getsize(layout.block_path(key)) == BS + TRAILER_SIZE

    primary[:] = bytes(len(primary))
    targets = [15, 9, 8, 12, 10, 11]  # other rows, scrambled
    engine.submit_load(2, keys, targets)
    loaded = wait_jobs(engine, [2])[2]
    assert loaded.success and loaded.is_load and loaded.nbytes == 6 * BS
    for i, chunk in zip(ids, targets):
        assert row(primary, chunk) == pattern(i), f"block {i} came back wrong"
    for chunk in range(6):
        assert row(primary, chunk) == bytes(BS)  # rows not loaded into stay zero
    assert engine.counters[Outcome.VERIFIED] == 6
    assert engine.counters[Tally.BYTES_READ] == 6 * BS
    assert loaded.io_seconds >= 0.0

    # Storing the same keys again finds them present: nothing moved.
    assert engine.submit_store(3, keys[:2], [15, 9])
    again = wait_jobs(engine, [3])[3]
    assert again.success and again.nbytes == 0
    assert engine.counters[Outcome.PRESENT] == 2
    assert engine.counters[Tally.BYTES_WRITTEN] == 6 * BS
    assert not engine.has_pending_work()


# -- I/O mode -------------------------------------------------------------------------------


def test_o_direct_chosen_on_tmpfs_and_ext4(volume, engines):
    engine, _, _ = engines(volume, n_blocks=2)
    assert engine.roots[0].use_o_direct is True
    assert engine.roots[0].blockio.options.use_o_direct is True


def test_buffered_mode_never_uses_o_direct(volume, engines):
    engine, _, primary = engines(volume, n_blocks=2, io_mode="buffered")
    assert engine.roots[0].use_o_direct is False
    assert engine.roots[0].blockio.options.use_o_direct is False
    store_blocks(engine, primary, 1, [0], [0])


def test_direct_mode_with_unaligned_block_size_raises(disk_root):
    block_size = 4096 + 512
    layout = CacheLayout.for_identity(disk_root, IDENTITY)
    primary = mmap.mmap(-1, 4 * block_size)
    settings = TierSettings(
        root_dir=disk_root, io_mode="direct", n_read_threads=1, n_write_threads=1, lookup_threads=1
    )
    with pytest.raises(EngineError) as info:
        FsEngine(settings, layout, primary, block_size)
    message = str(info.value)
    assert "io_mode=direct" in message
    assert "not page aligned" in message
    assert "buffered" in message  # tells the fix


def test_auto_mode_with_unaligned_block_size_falls_back(disk_root, engines):
    block_size = 4096 + 512
    engine, _, primary = engines(disk_root, n_blocks=4, block_size=block_size)
    assert engine.roots[0].use_o_direct is False
    data = pattern("odd", block_size)
    primary[block_size : 2 * block_size] = data
    assert engine.submit_store(1, [make_key("odd")], [1])
    assert wait_jobs(engine, [1])[1].success
    primary[:] = bytes(len(primary))
    engine.submit_load(2, [make_key("odd")], [3])
    assert wait_jobs(engine, [2])[2].success
    assert primary[3 * block_size : 4 * block_size] == data


def test_buffer_not_whole_blocks_raises(disk_root):
    layout = CacheLayout.for_identity(disk_root, IDENTITY)
    with pytest.raises(EngineError, match="whole number"):
        FsEngine(TierSettings(root_dir=disk_root), layout, mmap.mmap(-1, BS + 4096), BS)


def test_prepare_volume_creates_a_missing_root(tmp_path):
    """As vLLM's built-in does (tests/volume/test_pinned_root.py has the rest)."""
    layout = CacheLayout.for_identity(str(tmp_path / "new" / "kv"), IDENTITY)
    assert prepare_volume(layout).run_config_state == "created"
    assert os.path.isfile(layout.config_path)


def test_engine_prepares_its_volume(tmp_path):
    """Constructing the engine is the one way in: it checks the root and
    writes config.json before any thread starts."""
    blocked = CacheLayout.for_identity(str(tmp_path / "a-file"), IDENTITY)
    (tmp_path / "a-file").write_bytes(b"")
    settings = TierSettings(
        root_dir=blocked.root_dir, n_read_threads=1, n_write_threads=1, lookup_threads=1
    )
    with pytest.raises(EngineError, match="not a directory"):
        FsEngine(settings, blocked, mmap.mmap(-1, BS), BS)
    root = str(tmp_path)
    layout = CacheLayout.for_identity(root, IDENTITY)
    for expected in ("created", "matched"):
        engine = FsEngine(
            TierSettings(root_dir=root, n_read_threads=1, n_write_threads=1, lookup_threads=1),
            layout,
            mmap.mmap(-1, BS),
            BS,
        )
        try:
            assert engine.roots[0].run_config_state == expected
            assert os.path.isfile(layout.config_path) and os.path.isdir(layout.rank_dir)
        finally:
            engine.shutdown()


# -- verification, quarantine, trailer-less files -------------------------------------------


def test_missing_file_load_fails(disk_root, engines):
    engine, _, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 1, [0], [0])
    engine.submit_load(2, [make_key(0), make_key("nope")], [1, 2])
    job = wait_jobs(engine, [2])[2]
    assert not job.success
    assert job.failed == [make_key("nope")] and job.succeeded == [make_key(0)]
    assert job.nbytes == BS
    assert engine.counters[Direction.LOAD, Failure.MISSING] == 1
    assert engine.counters[Tally.QUARANTINED] == 0
    assert row(primary, 1) == pattern(0)


@pytest.mark.parametrize(
    "offset, reason",
    [
        (12345, "bad-checksum"),  # payload bit flip
        (BS + 50, "bad-trailer"),  # inside the trailer's key
        (BS + 0, "bad-magic"),
    ],
)
def test_corrupt_file_is_quarantined(disk_root, engines, offset, reason):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 1, [0], [0])
    path = layout.block_path(make_key(0))
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x08]))
    engine.submit_load(2, [make_key(0)], [1])
    job = wait_jobs(engine, [2])[2]
    assert not job.success and job.failed == [make_key(0)] and job.nbytes == 0
    assert engine.counters[Tally.QUARANTINED] == 1
    assert engine.counters[Corruption(reason)] == 1
    assert not os.path.lexists(path)
    moved = os.listdir(layout.quarantine_dir)
    assert len(moved) == 1
    assert moved[0].startswith(os.path.basename(path)) and f".{reason}." in moved[0]
    assert os.path.getsize(os.path.join(layout.quarantine_dir, moved[0])) == BS + TRAILER_SIZE
    # The quarantined block is gone for lookups and for a second load.
    assert settle(engine, make_key(0), "req") is False
    engine.submit_load(3, [make_key(0)], [1])
    assert not wait_jobs(engine, [3])[3].success
    assert engine.counters[Direction.LOAD, Failure.MISSING] == 1


def test_truncated_file_is_quarantined(disk_root, engines):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 1, [0], [0])
    path = layout.block_path(make_key(0))
    os.truncate(path, BS // 2)
    engine.submit_load(2, [make_key(0)], [1])
    assert not wait_jobs(engine, [2])[2].success
    assert engine.counters[Corruption.TRUNCATED] == 1
    assert not os.path.lexists(path)
    assert len(os.listdir(layout.quarantine_dir)) == 1


def test_trailerless_file_loads_unverified_when_accepted(volume, engines):
    engine, layout, primary = engines(volume, n_blocks=4, accept_trailerless=True)
    key = make_key("vllm-builtin")
    path = layout.block_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(pattern("raw"))
    assert settle(engine, key, "req") is True
    engine.submit_load(1, [key], [2])
    job = wait_jobs(engine, [1])[1]
    assert job.success and job.nbytes == BS
    assert row(primary, 2) == pattern("raw")
    assert engine.counters[Outcome.UNVERIFIED] == 1
    assert engine.counters[Outcome.VERIFIED] == 0
    assert engine.counters[Tally.BYTES_READ] == BS
    # A store of that key treats the existing file as present.
    assert engine.submit_store(2, [key], [0])
    assert wait_jobs(engine, [2])[2].success
    assert engine.counters[Outcome.PRESENT] == 1
    assert os.path.getsize(path) == BS


def test_trailerless_file_is_refused_by_default_and_replaced_by_a_store(volume, engines):
    engine, layout, primary = engines(volume, n_blocks=4)
    key = make_key("vllm-builtin")
    path = layout.block_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(pattern("raw"))
    assert settle(engine, key, "req") is False  # nothing we could verify is there
    engine.submit_load(1, [key], [2])
    assert not wait_jobs(engine, [1])[1].success  # the row's bytes are never reported
    assert engine.counters[Corruption.BAD_LENGTH] == 1
    assert not os.path.exists(path)  # quarantined
    store_blocks(engine, primary, 2, ["vllm-builtin"], [0])
    assert engine.counters[Outcome.WRITTEN] == 1
    assert os.path.getsize(path) == BS + TRAILER_SIZE


# -- lookups ----------------------------------------------------------------------------------


def test_lookup_verdicts_follow_loads_and_stores(disk_root, engines):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 1, ["here"], [0])
    here, absent = make_key("here"), make_key("absent")

    assert engine.lookup(here, "req") is None
    assert engine.lookup(absent, "req") is None
    assert engine.lookup(here, "req") is None  # not answered before end_step
    assert settle(engine, here, "req") is True
    assert settle(engine, absent, "req") is False
    assert inside(engine).tracked_keys() == 2

    # The file disappears; a load fails and the held verdict flips to False.
    os.unlink(layout.block_path(here))
    engine.submit_load(2, [here], [1])
    assert not wait_jobs(engine, [2])[2].success
    assert engine.lookup(here, "req") is False

    # A store lands for a key held as False: it flips to True.
    fill(primary, 2, pattern("absent"))
    assert engine.submit_store(3, [absent], [2])
    assert wait_jobs(engine, [3])[3].success
    assert engine.lookup(absent, "req") is True

    engine.forget_request("req")
    assert inside(engine).tracked_keys() == 0
    # A new request asks again from scratch.
    assert engine.lookup(absent, "req2") is None
    assert settle(engine, absent, "req2") is True
    engine.forget_request("req2")
    assert inside(engine).tracked_keys() == 0


def test_lookup_batch_over_parallel_threshold(disk_root, engines):
    engine, _, primary = engines(disk_root, n_blocks=16, lookup_threads=4)
    store_blocks(engine, primary, 1, range(6), range(6))
    keys = [make_key(i) for i in range(12)]  # 6 stored, 6 not: one batch of 12
    assert all(engine.lookup(k, "r") is None for k in keys)
    verdicts = [settle(engine, k, "r") for k in keys]
    assert verdicts == [True] * 6 + [False] * 6
    engine.forget_request("r")
    assert inside(engine).tracked_keys() == 0


def test_key_shared_by_two_requests_survives_one_forget(disk_root, engines):
    engine, _, primary = engines(disk_root, n_blocks=2)
    store_blocks(engine, primary, 1, [0], [0])
    assert settle(engine, make_key(0), "a") is True
    assert engine.lookup(make_key(0), "b") is True  # verdict shared
    engine.forget_request("a")
    assert inside(engine).tracked_keys() == 1
    assert engine.lookup(make_key(0), "b") is True
    engine.forget_request("b")
    assert inside(engine).tracked_keys() == 0


def test_planted_symlink_is_not_a_block(disk_root, engines, tmp_path):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    key = make_key("linked")
    store_blocks(engine, primary, 1, ["linked"], [0])  # a valid file for this very key
    path = layout.block_path(key)
    elsewhere = str(tmp_path / "elsewhere.bin")
    os.rename(path, elsewhere)
    os.symlink(elsewhere, path)

    assert settle(engine, key, "req") is False
    engine.submit_load(2, [key], [1])
    job = wait_jobs(engine, [2])[2]
    assert not job.success and job.failed == [key]
    assert row(primary, 1) == bytes(BS)  # nothing was read through the link
    assert engine.counters[Outcome.VERIFIED] == 0
    # The target was neither read into a successful load nor moved.
    assert os.path.getsize(elsewhere) == BS + TRAILER_SIZE
    with open(elsewhere, "rb") as f:
        assert unpack_trailer(f.read()[BS:]).key == key


def test_symlink_refusal_is_not_counted_as_quarantined(disk_root, engines, tmp_path):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    key = make_key("linked")
    store_blocks(engine, primary, 1, ["linked"], [0])
    path = layout.block_path(key)
    elsewhere = str(tmp_path / "elsewhere.bin")
    os.rename(path, elsewhere)
    os.symlink(elsewhere, path)
    engine.submit_load(2, [key], [1])
    assert not wait_jobs(engine, [2])[2].success
    assert os.path.islink(path)  # left in place
    in_quarantine = (
        os.listdir(layout.quarantine_dir) if os.path.isdir(layout.quarantine_dir) else []
    )
    assert engine.counters[Tally.QUARANTINED] == len(in_quarantine) == 0


# -- misc ---------------------------------------------------------------------------------------


def test_engine_and_layout_import_without_vllm_or_torch():
    code = (
        "import sys, llmkv_fs.engine, llmkv_fs.layout, llmkv_fs.config; "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('vllm','torch'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("is_load", [False, True], ids=["store", "load"])
def test_chunk_outside_buffer_fails_that_block_only(disk_root, engines, caplog, is_load):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    ids = [0, 1, 2, 3]
    keys = [make_key(i) for i in ids]
    if is_load:
        store_blocks(engine, primary, 1, [0, 3], [0, 3])
        primary[:] = bytes(len(primary))
        engine.submit_load(2, keys, [2, 4, -1, 1])
    else:
        for c, i in zip([0, 4, -1, 1], ids):
            if 0 <= c < 4:
                fill(primary, c, pattern(i))
        assert engine.submit_store(2, keys, [0, 4, -1, 1])
    with caplog.at_level(logging.WARNING, logger="vllm.llmkv_fs.engine"):
        job = wait_jobs(engine, [2])[2]
    assert caplog.text.count("IndexError") == 1, caplog.text  # throttled: one line per kind
    if is_load:
        # A load delivers only the blocks before its first failure (vLLM's
        # prefix rule); block 2 failed too if a thread took it before block
        # 1 failed, else it was skipped like block 3.
        assert job.succeeded == [keys[0]] and job.failed == keys[1:]
        errors = engine.counters[Direction.LOAD, Failure.ERROR]
        assert errors in (1, 2)
        assert errors + engine.counters[Direction.LOAD, Failure.SKIPPED] == 3
        assert row(primary, 2) == pattern(0)
        assert row(primary, 3) == bytes(BS)  # the -1 chunk did not wrap to the last row
    else:
        assert sorted(job.failed) == sorted([keys[1], keys[2]])
        assert sorted(job.succeeded) == sorted([keys[0], keys[3]])
        assert engine.counters[Direction.STORE, Failure.ERROR] == 2
        assert not os.path.lexists(layout.block_path(keys[1]))
        assert not os.path.lexists(layout.block_path(keys[2]))
        assert os.path.exists(layout.block_path(keys[3]))


def test_a_crashing_existence_check_answers_miss_not_retry_forever(disk_root, engines, monkeypatch):
    def broken(self, key):
        raise RuntimeError("bug in a check")

    replace_checks(monkeypatch, broken)  # a non-OSError escapes the check
    engine, _, primary = engines(disk_root, n_blocks=2)
    store_blocks(engine, primary, 1, [0], [0])
    assert settle(engine, make_key(0), "req") is False
    assert settle(engine, make_key(5), "req") is False


@pytest.mark.threads_only("the throttled log is the owner's; the failure is injected in-process")
def test_repeated_block_errors_are_logged_once_per_interval(
    disk_root, engines, caplog, engine_clock, monkeypatch
):  # the interval is the test's clock: three jobs on a loaded machine stay inside it
    # compiled_io off: BlockIO.store is replaced in-process
    engine, _, _primary = engines(disk_root, n_blocks=4, compiled_io=False)

    def failing_store(key, row_view, cancelled=None, pause=None):
        raise OSError(5, "Input/output error")  # not ENOSPC: that trips the space guard

    engine.roots[0].blockio.store = failing_store
    with caplog.at_level(logging.WARNING, logger="vllm.llmkv_fs.engine"):
        for job_id in range(3):
            assert engine.submit_store(job_id, [make_key(job_id)], [job_id])
            assert not wait_jobs(engine, [job_id])[job_id].success
    assert engine.counters[Direction.STORE, Failure.ERROR] == 3
    messages = [
        r.getMessage() for r in caplog.records if "store of a block failed" in r.getMessage()
    ]
    assert len(messages) == 1 and "Input/output error" in messages[0]


@pytest.mark.threads_only(
    "simulates a filesystem refusing rename over a name by patching os in-process"
)
def test_rename_refused_because_another_writer_won_counts_as_present(
    disk_root, engines, monkeypatch
):
    # compiled_io off: os.access and os.rename are patched in-process
    engine, layout, primary = engines(disk_root, n_blocks=2, compiled_io=False)
    real_rename = os.rename

    def rename_like_a_shared_fs(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        if real_access(dst, os.F_OK, dir_fd=dst_dir_fd, follow_symlinks=False):
            raise FileExistsError(17, "File exists", dst)
        return real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    fill(primary, 0, pattern(0))
    assert engine.submit_store(1, [make_key(0)], [0])
    assert wait_jobs(engine, [1])[1].success
    os.unlink(layout.block_path(make_key(0)))
    # Another writer publishes between our existence check and our rename.
    real_access = os.access

    # The store checks and renames relative to the block's directory.
    block_name = os.path.basename(layout.block_path(make_key(0)))

    def access_then_race(path, mode, **kw):
        answer = real_access(path, mode, **kw)
        if path == block_name and not answer:
            with open(layout.block_path(make_key(0)), "wb") as f:
                f.write(b"\0" * (BS + TRAILER_SIZE))
        return answer

    monkeypatch.setattr(os, "rename", rename_like_a_shared_fs)
    monkeypatch.setattr(os, "access", access_then_race)
    assert engine.submit_store(2, [make_key(0)], [0])
    assert wait_jobs(engine, [2])[2].success
    assert engine.counters[Outcome.PRESENT] == 1
    leftovers = [
        n for n in os.listdir(os.path.dirname(layout.block_path(make_key(0)))) if n.endswith(".tmp")
    ]
    assert leftovers == []


def test_a_fifo_planted_at_a_block_path_fails_the_load_instead_of_hanging(disk_root, engines):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 1, ["good"], [0])
    path = layout.block_path(make_key("fifo"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)  # open(O_RDONLY) of a FIFO blocks until a writer appears
    fill(primary, 1, b"\x00" * BS)
    # The good block first: a load delivers only the blocks before its first failure.
    engine.submit_load(2, [make_key("good"), make_key("fifo")], [2, 1])
    job = wait_jobs(engine, [2])[2]  # wait_jobs has a deadline: a hang fails here
    assert job.failed == [make_key("fifo")] and job.succeeded == [make_key("good")]
    assert row(primary, 2) == pattern("good")
    assert engine.counters[Direction.LOAD, Failure.ERROR] == 1
