"""Hashing in pieces. On a memory filesystem a block's contents
(block/contents.py) are written in pieces, each hashed right after its
write (the kernel's copy has just brought it into cache), then the trailer
is packed and written. The file is the payload plus a trailer whose
checksum is the whole payload's, whatever the piece; a load hashes the same
way.

The piece depends on who moves the bytes (engine/startup/io_setup.py):
256 KiB, which stays in cache while every place copies at once, for worker
processes and for I/O threads on the compiled byte path (it hashes a whole
slice without the GIL); 1 MiB for I/O threads on the Python path (each
piece there is one more GIL hand-off). Sealed blocks likewise: threads seal a
whole block (up to 4 MiB) in one cipher call, workers 256 KiB pieces. What a
worker process moves blocks with is what it was started with: the launch
spec on its command line, read from /proc. Real tmpfs and ext4, real worker
processes, bytes checked through both."""

from __future__ import annotations

import os

import pytest
import xxhash

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.engine.block import contents
from llmkv_fs.engine.block.bytes_c import compiled_available
from llmkv_fs.engine.block.contents import BlockContents
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.outcomes import Outcome
from llmkv_fs.engine.workers.crew import WorkerLaunch
from llmkv_fs.layout.blockfile import TRAILER_SIZE, verify_block
from llmkv_fs.layout.paths import CacheLayout
from tests.kits.engine_kit import IDENTITY, inside, memfd_primary, round_trip, worker_engine

KEY = bytes(range(36))


def _contents(tmp_path, block: int, piece: int) -> BlockContents:
    root = str(tmp_path / "kv")
    layout = CacheLayout(root, CacheLayout.for_identity(root, IDENTITY).run_config, 0)
    return BlockContents(layout, IoOptions(block, False, False, False, True, hash_chunk=piece))


@pytest.mark.parametrize(("block", "piece"), [(64 << 10, 16 << 10), (64 << 10, 32 << 10)])
def test_file_is_payload_then_trailer_with_the_whole_payload_hash(tmp_path, block, piece):
    payload = os.urandom(block)
    row = memoryview(bytearray(payload))
    trailer = memoryview(bytearray(TRAILER_SIZE))
    path = tmp_path / "b"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _contents(tmp_path, block, piece).write(fd, KEY, row, trailer)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == block + TRAILER_SIZE
    assert data[:block] == payload
    got = verify_block(data[:block], data[block:], KEY, True)
    assert got.has_checksum and got.payload_xxh3 == xxhash.xxh3_64_intdigest(payload)
    # Read back in pieces: the same bytes, checked against the hash taken on the way.
    back, scratch = memoryview(bytearray(block)), memoryview(bytearray(2 * TRAILER_SIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _contents(tmp_path, block, piece).read(fd, KEY, back, scratch) is Outcome.VERIFIED
    finally:
        os.close(fd)
    assert bytes(back) == payload


def test_a_flipped_bit_read_in_pieces_is_refused(tmp_path):
    block, piece = 64 << 10, 16 << 10
    row = memoryview(bytearray(os.urandom(block)))
    trailer = memoryview(bytearray(TRAILER_SIZE))
    path = tmp_path / "b"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _contents(tmp_path, block, piece).write(fd, KEY, row, trailer)
    finally:
        os.close(fd)
    data = bytearray(path.read_bytes())
    data[block - 1] ^= 1  # in the last piece, the one read with the trailer
    path.write_bytes(bytes(data))
    back, scratch = memoryview(bytearray(block)), memoryview(bytearray(2 * TRAILER_SIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(Exception, match="checksum"):
            _contents(tmp_path, block, piece).read(fd, KEY, back, scratch)
    finally:
        os.close(fd)


def test_each_piece_is_hashed_after_its_write(tmp_path, monkeypatch):
    events: list[tuple[str, int]] = []
    real_write_all, real_hasher = contents.write_all, xxhash.xxh3_64

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

    monkeypatch.setattr(contents, "write_all", write_all)
    monkeypatch.setattr(contents.xxhash, "xxh3_64", Hasher)
    row = memoryview(bytearray(os.urandom(4 * 4096)))
    trailer = memoryview(bytearray(TRAILER_SIZE))
    fd = os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _contents(tmp_path, 4 * 4096, 8192).write(fd, KEY, row, trailer)
    finally:
        os.close(fd)
    piece = [("write", 8192), ("hash", 8192)]
    assert events == [*piece, *piece, ("write", TRAILER_SIZE)]


def test_whole_blocks_move_in_one_call(tmp_path, monkeypatch):
    calls: list[int] = []
    real_write_all = contents.write_all

    def write_all(fd, buffers, offset=0):
        calls.append(len(buffers))
        real_write_all(fd, buffers, offset)

    monkeypatch.setattr(contents, "write_all", write_all)
    row = memoryview(bytearray(os.urandom(64 << 10)))
    trailer = memoryview(bytearray(TRAILER_SIZE))
    fd = os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _contents(tmp_path, 64 << 10, 0).write(fd, KEY, row, trailer)
    finally:
        os.close(fd)
    assert calls == [2]  # row and trailer, one pwritev


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
            assert threads_piece == (256 << 10 if compiled_available() else 1 << 20)
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


@pytest.mark.parametrize("compiled_io", [True, False])
def test_threads_on_the_python_path_hash_in_larger_pieces(compiled_io, mount_tmpfs):
    base = mount_tmpfs("64m")
    settings = TierSettings(root_dir=f"{base}/kv", io_workers=0, compiled_io=compiled_io)
    primary = memfd_primary(4 * (2 << 20))
    engine = FsEngine(
        settings, CacheLayout.for_identity(settings.root_dir, IDENTITY), primary, 2 << 20
    )
    try:
        compiled = compiled_io and compiled_available()
        assert engine.roots[0].blockio.options.hash_chunk == (256 << 10 if compiled else 1 << 20)
        round_trip(engine, primary, 4)
    finally:
        engine.shutdown()
