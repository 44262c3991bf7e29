"""A block written with ``checksum: false`` carries a trailer (length, key)
but no payload checksum. A reader never counts it as verified; one with
``checksum: true`` refuses it (``no_checksum``, the file left in place)
unless it accepts unverified blocks (``accept_trailerless``).
"""

import os

from llmkv_fs.engine import Direction, Failure, Outcome, Tally
from llmkv_fs.layout.blockfile import TRAILER_SIZE, unpack_trailer
from tests.kits.engine_kit import BS, make_key, pattern, row, settle, store_blocks, wait_jobs
from tests.kits.volume_kit import flip_a_bit


def write_unchecked(engines, root) -> tuple[bytes, str]:
    writer, layout, primary = engines(root, n_blocks=2, checksum=False)
    store_blocks(writer, primary, 1, ["plain"], [0])
    key = make_key("plain")
    path = layout.block_path(key)
    with open(path, "rb") as f:
        f.seek(BS)
        assert not unpack_trailer(f.read(TRAILER_SIZE)).has_checksum
    flip_a_bit(path, offset=777)
    return key, path


def test_checksumming_reader_refuses_a_bit_flipped_block_written_without_checksum(
    disk_root, engines
):
    key, path = write_unchecked(engines, disk_root)
    reader, _layout, _primary = engines(disk_root, n_blocks=2)  # checksum: true
    assert settle(reader, key, "r") is True  # the file is there, the right size
    assert reader.submit_load(1, [key], [1])
    job = wait_jobs(reader, [1])[1]
    assert job.failed == [key] and job.succeeded == []
    c = reader.counters
    assert c[Outcome.VERIFIED] == 0 and c[Outcome.UNVERIFIED] == 0
    assert c[Direction.LOAD, Failure.NO_CHECKSUM] == 1
    assert c[Tally.BYTES_READ] == 0
    assert c[Tally.QUARANTINED] == 0 and os.path.exists(path)  # not corrupt: left alone
    reader.forget_request("r")
    assert reader.lookup(key, "again") is False  # remembered: not re-read


def test_opting_in_serves_it_as_unverified_never_verified(disk_root, engines):
    key, _path = write_unchecked(engines, disk_root)
    reader, _layout, primary = engines(disk_root, n_blocks=2, accept_trailerless=True)
    assert reader.submit_load(1, [key], [1])
    assert wait_jobs(reader, [1])[1].success
    assert reader.counters[Outcome.UNVERIFIED] == 1
    assert reader.counters[Outcome.VERIFIED] == 0
    assert row(primary, 1) != pattern("plain")  # the flipped bit: what opting in risks


def test_a_reader_without_checksums_counts_what_it_loads_unverified(disk_root, engines):
    writer, _layout, primary = engines(disk_root, n_blocks=2)
    store_blocks(writer, primary, 1, ["sum"], [0])
    reader, _layout, rprimary = engines(disk_root, n_blocks=2, checksum=False)
    assert reader.submit_load(1, [make_key("sum")], [1])
    assert wait_jobs(reader, [1])[1].success
    assert row(rprimary, 1) == pattern("sum")
    assert reader.counters[Outcome.UNVERIFIED] == 1
    assert reader.counters[Outcome.VERIFIED] == 0
