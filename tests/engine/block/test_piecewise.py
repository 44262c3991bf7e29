"""Hashing in pieces. On a memory filesystem the default byte path
(VectoredBytes) writes the payload in pieces and hashes each piece right
after its write (the kernel's copy has just brought it into cache), then
seals and writes the trailer. The file is the payload plus a trailer whose
checksum is the whole payload's, whatever the piece; a load hashes the same
way.

The piece depends on who moves the bytes (engine/startup/io_setup.py):
1 MiB for I/O threads in vLLM's process (each piece is one more GIL
hand-off), 256 KiB for worker processes (no GIL; many busy workers evict a
1 MiB piece before it is hashed); sealed blocks likewise: threads seal a
whole block (up to 4 MiB) in one cipher call, workers 256 KiB pieces. What a
worker process moves blocks with is what it was started with: the launch
spec on its command line, read from /proc. Real tmpfs and ext4, real worker
processes, bytes checked through both."""

from __future__ import annotations

import dataclasses
import os

import pytest
import xxhash

from llmkv_fs.engine.block import bytepath
from llmkv_fs.engine.block.bytepath import VectoredBytes
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.workers.crew import WorkerLaunch
from llmkv_fs.layout.blockfile import TRAILER_SIZE, file_sizes, pack_trailer, verify_block
from tests.kits.engine_kit import inside, round_trip, worker_engine

KEY = bytes(range(36))


def _options(block: int, piece: int) -> IoOptions:
    return IoOptions(block, False, False, False, True, hash_chunk=piece)


def _seal(trailer: memoryview, row: memoryview, seen: list[int | None]):
    def seal(digest: int | None) -> None:
        seen.append(digest)
        pack_trailer(trailer, KEY, row.nbytes, digest, 123)

    return seal


@pytest.mark.parametrize(("block", "piece"), [(64 << 10, 16 << 10), (64 << 10, 32 << 10)])
def test_file_is_payload_then_trailer_with_the_whole_payload_hash(tmp_path, block, piece):
    payload = os.urandom(block)
    row = memoryview(bytearray(payload))
    trailer = memoryview(bytearray(TRAILER_SIZE))
    path = tmp_path / "b"
    digests: list[int | None] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        VectoredBytes(_options(block, piece)).write(fd, row, trailer, _seal(trailer, row, digests))
    finally:
        os.close(fd)
    assert digests == [xxhash.xxh3_64_intdigest(payload)]  # sealed once, with the hash
    data = path.read_bytes()
    assert len(data) == block + TRAILER_SIZE
    assert data[:block] == payload
    got = verify_block(data[:block], data[block:], KEY, True)
    assert got.has_checksum and got.payload_xxh3 == xxhash.xxh3_64_intdigest(payload)
    # Read back in pieces: the same bytes, the digest computed on the way.
    back, tail = memoryview(bytearray(block)), memoryview(bytearray(2 * TRAILER_SIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        n, digest = VectoredBytes(_options(block, piece)).read(
            fd, back, tail, file_sizes(block, False)
        )
    finally:
        os.close(fd)
    assert (n, digest) == (block + TRAILER_SIZE, xxhash.xxh3_64_intdigest(payload))
    assert bytes(back) == payload


def test_whole_blocks_move_in_one_call_and_leave_the_hash_to_the_caller(tmp_path):
    options = dataclasses.replace(_options(64 << 10, 0))
    row = memoryview(bytearray(os.urandom(64 << 10)))
    trailer = memoryview(bytearray(TRAILER_SIZE))
    digests: list[int | None] = []
    fd = os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        VectoredBytes(options).write(fd, row, trailer, _seal(trailer, row, digests))
    finally:
        os.close(fd)
    assert digests == [None]


def test_each_piece_is_hashed_after_its_write(tmp_path, monkeypatch):
    events: list[tuple[str, int]] = []
    real_write_all, real_hasher = bytepath.write_all, xxhash.xxh3_64

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

    monkeypatch.setattr(bytepath, "write_all", write_all)
    monkeypatch.setattr(bytepath.xxhash, "xxh3_64", Hasher)
    row = memoryview(bytearray(os.urandom(4 * 4096)))
    trailer = memoryview(bytearray(TRAILER_SIZE))
    fd = os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        VectoredBytes(_options(4 * 4096, 8192)).write(fd, row, trailer, _seal(trailer, row, []))
    finally:
        os.close(fd)
    piece = [("write", 8192), ("hash", 8192)]
    assert events == [*piece, *piece, ("write", TRAILER_SIZE)]


# -- the piece, by who moves the bytes ---------------------------------------------


def worker_options(pid: int) -> IoOptions:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    launch = WorkerLaunch.decoded(argv[3].decode())  # python -c CODE LAUNCH
    (root,) = launch.step.roots  # one root here
    return root.options


@pytest.mark.parametrize("medium", ["tmpfs", "ext4"])
def test_workers_hash_and_seal_in_smaller_pieces_than_threads(medium, mount_tmpfs, tmp_path):
    base = mount_tmpfs("64m") if medium == "tmpfs" else str(tmp_path)
    # 2 MiB blocks: larger than either piece, so both paths hash in pieces.
    engine, primary = worker_engine(f"{base}/kv", 8, 2 << 20)
    try:
        threads_piece = engine.roots[0].blockio.options.hash_chunk
        pieces = [worker_options(pid).hash_chunk for pid in inside(engine).executor.worker_pids()]
        if medium == "tmpfs":
            assert threads_piece == 1 << 20
            assert pieces == [256 << 10, 256 << 10]
        else:  # a disk: one large read matters more than the cache
            assert threads_piece == 0 and pieces == [0, 0]
        assert engine.roots[0].blockio.options.seal_piece == 4 << 20
        assert [
            worker_options(pid).seal_piece for pid in inside(engine).executor.worker_pids()
        ] == [256 << 10] * 2
        round_trip(engine, primary, 8)
    finally:
        engine.shutdown()
