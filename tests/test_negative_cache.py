"""A key whose load failed in a way that would repeat answers MISS to new
requests for ``failed_load_miss_s``, without being read again: a bad file
that could not be moved aside (its quarantine directory is read-only)
and a file the kernel answers with EIO. Real files, a real loop-mounted
ext4 shut down under the engine.
"""

import os
import subprocess
import time

from llmkv_fs.config import SETTINGS
from llmkv_fs.engine import Direction, Failure
from llmkv_fs.engine.lookup import _MAX_REMEMBERED_MISSES, AsyncExistence
from llmkv_fs.layout.blockfile import Corruption

from engine_kit import make_key, settle, store_blocks, wait_jobs
from matrix_kit import ext4_shutdown, loop_ext4
from volume_kit import flip_a_bit


def loads_seen(engine, gate_for):
    """A record of every load a block of ``engine`` starts from now on, in
    I/O threads or worker processes alike (an open gate only records)."""
    gate = gate_for(engine, kinds=("load",))
    gate.open()
    return gate


def fails_then_misses(engine, key: bytes, loads) -> None:
    """A request finds ``key``, its load fails; fresh requests then answer
    MISS at their first lookup (no probe, no RETRY) and never load it."""
    assert settle(engine, key, "first") is True
    assert engine.submit_load(1, [key], [1])
    assert not wait_jobs(engine, [1])[1].success
    engine.forget_request("first")
    for i in range(5):
        assert engine.lookup(key, f"again-{i}") is False
        engine.end_step()
        engine.forget_request(f"again-{i}")
    assert [k for _place, _kind, k in loads.entries] == [key]
    assert engine.lookups.remembered_misses() == 1


def test_bad_file_that_cannot_be_quarantined_is_a_miss_for_a_while(disk_root, engines, gate_for):
    engine, layout, primary = engines(disk_root, n_blocks=4)
    store_blocks(engine, primary, 0, ["bad"], [0])
    key = make_key("bad")
    flip_a_bit(layout.block_path(key), offset=100)
    # The quarantine directory is a read-only mount of its own: the move
    # aside fails (EXDEV/EROFS) the way it does on a volume gone read-only.
    qdir = layout.quarantine_dir
    os.makedirs(qdir)
    subprocess.run(["mount", "--bind", qdir, qdir], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", qdir], check=True)
        loads = loads_seen(engine, gate_for)

        fails_then_misses(engine, key, loads)
        c = engine.counters
        assert c[Direction.LOAD, Failure.CORRUPT] == 1 and c[Corruption.BAD_CHECKSUM] == 1
        assert c[Direction.LOAD, Failure.ERROR] == 0  # still a bad file, not an I/O error
        assert os.path.exists(layout.block_path(key))  # left in place
        assert os.listdir(qdir) == []
    finally:
        subprocess.run(["umount", "-l", qdir], check=False)


def test_a_block_answering_eio_is_a_miss_for_a_while(tmp_path, engines, gate_for):
    with loop_ext4(tmp_path / "eio") as root:
        engine, _layout, primary = engines(root, n_blocks=4)
        store_blocks(engine, primary, 0, ["eio"], [0])
        key = make_key("eio")
        os.sync()
        loads = loads_seen(engine, gate_for)
        ext4_shutdown(root)  # lstat still answers (cached); every read is EIO

        fails_then_misses(engine, key, loads)
        assert engine.counters[Direction.LOAD, Failure.ERROR] == 1


def test_remembered_misses_expire_and_are_bounded(tmp_path):
    probes: list[bytes] = []

    def exists(key: bytes) -> bool:
        probes.append(key)
        return True

    lookups = AsyncExistence(exists, 1, miss_for_s=60.0)
    try:
        lookups.remember_misses([b"old"], now=time.monotonic() - 61)
        lookups.remember_misses([b"new"])
        assert lookups.lookup(b"new", "r") is False  # no probe
        assert lookups.lookup(b"old", "r") is None  # expired: probed again
        lookups.end_step()
        deadline = time.monotonic() + 10
        while lookups.lookup(b"old", "r") is None:
            assert time.monotonic() < deadline
            lookups.end_step()
            time.sleep(0.002)
        assert probes == [b"old"]
        assert lookups.remembered_misses() == 1  # the expired entry is gone
        lookups.remember_misses(i.to_bytes(4, "big") for i in range(_MAX_REMEMBERED_MISSES + 5))
        assert lookups.remembered_misses() == _MAX_REMEMBERED_MISSES
    finally:
        lookups.shutdown()
    doc = next(s.doc for s in SETTINGS if s.key == "failed_load_miss_s")
    assert str(_MAX_REMEMBERED_MISSES) in doc
