"""Issue 20: a store on a memory filesystem writes the payload in pieces and
hashes each piece right after its write (the kernel's copy has just brought
it into cache), then writes the trailer. The file is the payload plus a
trailer whose checksum is the whole payload's, whatever the piece."""

from __future__ import annotations

import os

import pytest
import xxhash

from llmkv_fs.engine.block import piecewise
from llmkv_fs.layout.blockfile import TRAILER_SIZE, verify_block

KEY = bytes(range(36))


@pytest.mark.parametrize(("block", "piece"), [(64 << 10, 16 << 10), (64 << 10, 24 << 10)])
def test_file_is_payload_then_trailer_with_the_whole_payload_hash(tmp_path, block, piece):
    payload = os.urandom(block)
    row = memoryview(bytearray(payload))
    trailer = memoryview(bytearray(TRAILER_SIZE))
    path = tmp_path / "b"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        piecewise.write_hashing(fd, row, piece, trailer, KEY, 123)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == block + TRAILER_SIZE
    assert data[:block] == payload
    got = verify_block(data[:block], data[block:], KEY, True)
    assert got.has_checksum and got.payload_xxh3 == xxhash.xxh3_64_intdigest(payload)


def test_each_piece_is_hashed_after_its_write(tmp_path, monkeypatch):
    events: list[tuple[str, int]] = []
    real_write_all, real_hasher = piecewise.write_all, xxhash.xxh3_64

    def write_all(fd, buffers, offset=0):
        events.append(("write", sum(memoryview(b).nbytes for b in buffers)))
        real_write_all(fd, buffers, offset)

    class Hasher:
        def __init__(self) -> None:
            self._h = real_hasher()

        def update(self, part) -> None:
            events.append(("hash", memoryview(part).nbytes))
            self._h.update(part)

        def intdigest(self) -> int:
            return self._h.intdigest()

    monkeypatch.setattr(piecewise, "write_all", write_all)
    monkeypatch.setattr(piecewise.xxhash, "xxh3_64", Hasher)
    row = memoryview(bytearray(os.urandom(4 * 4096)))
    fd = os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        piecewise.write_hashing(fd, row, 8192, memoryview(bytearray(TRAILER_SIZE)), KEY, 1)
    finally:
        os.close(fd)
    piece = [("write", 8192), ("hash", 8192)]
    assert events == [*piece, *piece, ("write", TRAILER_SIZE)]
