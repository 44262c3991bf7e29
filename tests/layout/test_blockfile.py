"""The block file format (layout/blockfile.py) and the file BlockIO.store
writes. No vLLM, no torch."""

from __future__ import annotations

import errno
import mmap
import os
import random
import struct
import time

import pytest
import xxhash

from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.outcomes import Outcome
from llmkv_fs.engine.startup.probe import probe_o_direct
from llmkv_fs.layout.blockfile import (
    FLAG_CHECKSUM,
    FORMAT_VERSION,
    MAGIC,
    MAX_KEY_LEN,
    TRAILER_SIZE,
    BlockFileError,
    pack_trailer,
    payload_checksum,
    unpack_trailer,
    verify_block,
)
from llmkv_fs.layout.paths import CacheLayout
from tests.kits.engine_kit import BS, IDENTITY, make_key

HEAD = 42  # magic..key length, see the format table in blockfile.py
KEY36 = make_key("long", hash_len=32)
KEY20 = make_key("short", hash_len=16)


def payload(seed: int = 1, size: int = BS) -> bytearray:
    return bytearray(random.Random(seed).randbytes(size))


def packed(key: bytes, data, checksum: int | None = -1, created: int = 123) -> bytearray:
    out = bytearray(TRAILER_SIZE)
    if checksum == -1:
        checksum = payload_checksum(data)
    pack_trailer(memoryview(out), key, len(data), checksum, created)
    return out


def reason_of(payload_, trailer, key, verify_checksum=True) -> str:
    with pytest.raises(BlockFileError) as info:
        verify_block(payload_, trailer, key, verify_checksum)
    return info.value.reason


# -- pack / unpack --------------------------------------------------------------------


def test_pack_unpack_round_trip_fields():
    data = payload()
    trailer = packed(KEY36, data, created=987654321)
    assert trailer[:8] == MAGIC
    parsed = unpack_trailer(trailer)
    assert parsed.version == FORMAT_VERSION
    assert parsed.flags == FLAG_CHECKSUM and parsed.has_checksum
    assert parsed.payload_len == BS
    assert parsed.payload_xxh3 == xxhash.xxh3_64_intdigest(bytes(data))
    assert parsed.created_ns == 987654321
    assert parsed.key == KEY36
    # Layout of the fields as documented (little-endian).
    assert struct.unpack_from("<Q", trailer, 16)[0] == BS
    assert struct.unpack_from("<H", trailer, 40)[0] == len(KEY36)
    assert bytes(trailer[HEAD : HEAD + len(KEY36)]) == KEY36
    tail = struct.unpack_from("<Q", trailer, HEAD + len(KEY36))[0]
    assert tail == xxhash.xxh3_64_intdigest(bytes(trailer[: HEAD + len(KEY36)]))
    assert not any(trailer[HEAD + len(KEY36) + 8 :])


def test_reused_buffer_long_then_short_key_leaves_zeros():
    data = payload()
    out = bytearray(TRAILER_SIZE)
    view = memoryview(out)
    pack_trailer(view, KEY36, len(data), payload_checksum(data), 1)
    assert unpack_trailer(out).key == KEY36
    pack_trailer(view, KEY20, len(data), payload_checksum(data), 2)
    parsed = unpack_trailer(out)
    assert parsed.key == KEY20 and parsed.created_ns == 2
    tail_end = HEAD + len(KEY20) + 8
    assert any(out[tail_end - 8 : tail_end])  # the tail checksum itself is there
    assert not any(out[tail_end:]), "bytes of the earlier, longer key survived"
    verify_block(data, out, KEY20, True)


def test_max_key_length():
    data = payload(size=4096)
    key = bytes(range(256)) * 4  # MAX_KEY_LEN bytes
    assert len(key) == MAX_KEY_LEN
    assert unpack_trailer(packed(key, data)).key == key
    with pytest.raises(ValueError):
        packed(key + b"x", data)


def test_unpack_short_buffer_is_truncated():
    with pytest.raises(BlockFileError) as info:
        unpack_trailer(bytes(20))
    assert info.value.reason == "truncated"


# -- verify_block -------------------------------------------------------------------------


def test_verify_accepts_good_block():
    data = payload()
    trailer = verify_block(data, packed(KEY36, data), KEY36, True)
    assert trailer.key == KEY36 and trailer.payload_len == BS


@pytest.mark.parametrize(
    "byte, bit", [(0, 0), (1, 7), (4095, 3), (BS // 2, 5), (BS - 1, 7), (BS - 1, 0)]
)
def test_single_bit_flip_in_payload_is_bad_checksum(byte, bit):
    data = payload()
    trailer = packed(KEY36, data)
    data[byte] ^= 1 << bit
    assert reason_of(data, trailer, KEY36) == "bad-checksum"
    # Not asking for the checksum lets it through (length and key still match).
    verify_block(data, trailer, KEY36, False)


def test_wrong_key():
    data = payload()
    trailer = packed(KEY36, data)
    assert reason_of(data, trailer, make_key("other")) == "wrong-key"
    assert reason_of(data, trailer, KEY36[:-1] + b"\x01") == "wrong-key"  # other group


def test_other_length_payload():
    data = payload()
    trailer = packed(KEY36, data)
    assert reason_of(data[:-4096], trailer, KEY36) == "bad-length"
    assert reason_of(data + bytes(4096), trailer, KEY36) == "bad-length"


def test_bad_magic():
    data = payload()
    trailer = packed(KEY36, data)
    trailer[0] ^= 0x01
    assert reason_of(data, trailer, KEY36) == "bad-magic"
    assert reason_of(data, bytes(TRAILER_SIZE), KEY36) == "bad-magic"


def _reseal(trailer: bytearray, key_len: int) -> None:
    key_end = HEAD + key_len
    struct.pack_into("<Q", trailer, key_end, xxhash.xxh3_64_intdigest(bytes(trailer[:key_end])))


def test_bad_version_with_valid_trailer_checksum():
    data = payload()
    trailer = packed(KEY36, data)
    # Resealing an untouched trailer keeps it valid: the hand computation is right.
    _reseal(trailer, len(KEY36))
    verify_block(data, trailer, KEY36, True)
    struct.pack_into("<H", trailer, 8, 3)  # 2 is the sealed format (layout/sealed.py)
    _reseal(trailer, len(KEY36))
    assert reason_of(data, trailer, KEY36) == "bad-version"


@pytest.mark.parametrize("offset", [HEAD, HEAD + 17, HEAD + 35])
def test_bit_flip_in_trailer_key_region_is_bad_trailer(offset):
    data = payload()
    trailer = packed(KEY36, data)
    trailer[offset] ^= 0x10
    assert reason_of(data, trailer, KEY36) == "bad-trailer"


@pytest.mark.parametrize("offset", [16, 24, 32, HEAD + 36])  # length, xxh3, time, tail
def test_bit_flip_in_other_trailer_fields_is_bad_trailer(offset):
    data = payload()
    trailer = packed(KEY36, data)
    trailer[offset] ^= 0x04
    assert reason_of(data, trailer, KEY36) == "bad-trailer"


def test_absurd_key_length_is_bad_trailer():
    data = payload()
    trailer = packed(KEY36, data)
    struct.pack_into("<H", trailer, 40, 60000)
    assert reason_of(data, trailer, KEY36) == "bad-trailer"


def test_no_checksum_recorded():
    data = payload()
    trailer = packed(KEY36, data, checksum=None)
    parsed = unpack_trailer(trailer)
    assert not parsed.has_checksum and parsed.flags == 0 and parsed.payload_xxh3 == 0
    data[100] ^= 0x01
    verify_block(data, trailer, KEY36, True)  # nothing to compare against
    assert reason_of(data, trailer, make_key("other")) == "wrong-key"
    assert reason_of(data[:4096], trailer, KEY36) == "bad-length"


# -- the file BlockIO.store writes --------------------------------------------------------


def _blockio(root: str, use_o_direct: bool, checksum: bool = True, hash_chunk: int = 0) -> BlockIO:
    layout = CacheLayout.for_identity(root, IDENTITY)
    os.makedirs(layout.rank_dir)
    return BlockIO(
        layout,
        IoOptions(
            block_size=BS,
            use_o_direct=use_o_direct,
            fsync_file=False,
            fsync_dir=False,
            checksum=checksum,
            hash_chunk=hash_chunk,
        ),
    )


# hash_chunk: stores (and loads) hash and move the payload in pieces on
# memory-backed volumes; the file must be the same as from one pass.
@pytest.mark.parametrize("hash_chunk", [0, 16 * 1024], ids=["one_pass", "pieces"])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_store_writes_payload_then_trailer(volume, direct, hash_chunk):
    bio = _blockio(volume, direct, hash_chunk=hash_chunk)
    if direct and not probe_o_direct(bio.layout.rank_dir):
        pytest.fail("O_DIRECT expected to work on tmpfs and ext4 (kernel >= 6.6)")
    primary = mmap.mmap(-1, 2 * BS)
    primary[BS:] = bytes(payload(7))
    row = memoryview(primary)[BS:]
    before = time.time_ns()
    assert bio.store(KEY36, row) is Outcome.WRITTEN
    after = time.time_ns()
    path = bio.layout.block_path(KEY36)
    assert os.path.getsize(path) == BS + TRAILER_SIZE
    with open(path, "rb") as f:
        data = f.read()
    assert data[:BS] == bytes(payload(7))
    trailer = unpack_trailer(data[BS:])
    assert trailer.key == KEY36
    assert trailer.payload_len == BS
    assert trailer.has_checksum
    assert trailer.payload_xxh3 == xxhash.xxh3_64_intdigest(data[:BS])
    assert before <= trailer.created_ns <= after
    assert not any(data[BS + HEAD + len(KEY36) + 8 :])
    # No temp file left next to it; a second store finds it present.
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    assert bio.store(KEY36, row) is Outcome.PRESENT
    # And it loads back verified into another row.
    other = memoryview(primary)[:BS]
    assert bio.load(KEY36, other) is Outcome.VERIFIED
    assert bytes(other) == bytes(payload(7))


def test_store_in_pieces_that_runs_out_of_space_leaves_nothing(mount_tmpfs):
    """ENOSPC after some pieces were written: no block file, no temp file."""
    volume = mount_tmpfs("512k")
    bio = _blockio(volume, False, hash_chunk=16 * 1024)
    filler = os.path.join(volume, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # fill the tmpfs, then free room for two pieces only
        while os.write(fd, b"\1" * 4096):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, os.path.getsize(filler) - 32 * 1024)
    primary = mmap.mmap(-1, BS)
    primary[:] = bytes(payload(5))
    with pytest.raises(OSError) as raised:
        bio.store(KEY36, memoryview(primary))
    assert raised.value.errno == errno.ENOSPC
    path = bio.layout.block_path(KEY36)
    assert not os.path.exists(path)
    assert os.listdir(os.path.dirname(path)) == []


def test_store_without_checksum_records_none(disk_root):
    bio = _blockio(disk_root, False, checksum=False)
    primary = mmap.mmap(-1, BS)
    primary[:] = bytes(payload(3))
    assert bio.store(KEY20, memoryview(primary)) is Outcome.WRITTEN
    with open(bio.layout.block_path(KEY20), "rb") as f:
        data = f.read()
    trailer = unpack_trailer(data[BS:])
    assert len(data) == BS + TRAILER_SIZE
    assert trailer.key == KEY20 and not trailer.has_checksum


def test_trailer_page_is_zero_after_reading_a_bad_file(disk_root):
    bio = _blockio(disk_root, False)
    bad_key, key = make_key("bad"), make_key("good")
    bad_path = bio.layout.block_path(bad_key)
    os.makedirs(os.path.dirname(bad_path), exist_ok=True)
    with open(bad_path, "wb") as f:
        f.write(b"\xab" * (BS + TRAILER_SIZE))
    primary = mmap.mmap(-1, BS)
    row = memoryview(primary)
    with pytest.raises(BlockFileError) as info:
        bio.load(bad_key, row)  # same thread: fills the scratch page with 0xab
    assert info.value.reason == "bad-magic"
    primary[:] = bytes(payload(5))
    assert bio.store(key, row) is Outcome.WRITTEN
    with open(bio.layout.block_path(key), "rb") as f:
        page = f.read()[BS:]
    assert unpack_trailer(page).key == key
    assert not any(page[HEAD + len(key) + 8 :])
