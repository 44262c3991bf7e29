"""Second implementations of the engine's byte path (engine/block/bytepath.py),
for tests/engine/block/test_bytepath.py. Importable by worker processes: the
test puts this directory on their PYTHONPATH, and each call leaves a mark in the
directory ``TRACE_ENV`` names (``<op>.<pid>``), so a test sees which process
moved the bytes."""

from __future__ import annotations

import os
from collections.abc import Callable, Container

from llmkv_fs.engine.block.options import IoOptions

TRACE_ENV = "LLMKV_FS_TEST_BYTES_TRACE"


class PlainBytes:
    """Moves bytes with ``pwrite``/``preadv`` of one buffer each (one
    buffer per call, never in pieces) and hashes nothing on the way: the
    engine's own checks must still hold everything together."""

    def __init__(self, options: IoOptions):
        self.block_size = options.block_size
        self._trace = os.environ[TRACE_ENV]

    def _note(self, op: str) -> None:
        with open(os.path.join(self._trace, f"{op}.{os.getpid()}"), "a") as f:
            f.write("x")

    def write(
        self, fd: int, row: memoryview, trailer: memoryview, seal: Callable[[int | None], None]
    ) -> None:
        self._note("write")
        _pwrite_all(fd, row, 0)
        seal(None)
        _pwrite_all(fd, trailer, row.nbytes)

    def read(
        self, fd: int, row: memoryview, tail: memoryview, sizes: Container[int]
    ) -> tuple[int, int | None]:
        self._note("read")
        done = _pread_into(fd, row, 0)
        if done < row.nbytes:
            return done, None
        return done + _pread_into(fd, tail, done), None


class FlippingBytes(PlainBytes):
    """Reads like PlainBytes, then flips one payload byte: a byte path that
    hands back a wrong byte. The checksum must catch it."""

    def read(
        self, fd: int, row: memoryview, tail: memoryview, sizes: Container[int]
    ) -> tuple[int, int | None]:
        n, digest = super().read(fd, row, tail, sizes)
        row[0] ^= 0xFF
        return n, digest


class ShortBytes(PlainBytes):
    """Writes one page less of the payload than it was given (the trailer
    after it, sealed) and returns normally: a byte path that lies."""

    def write(
        self, fd: int, row: memoryview, trailer: memoryview, seal: Callable[[int | None], None]
    ) -> None:
        self._note("write")
        _pwrite_all(fd, row[: row.nbytes - 4096], 0)
        seal(None)
        _pwrite_all(fd, trailer, row.nbytes - 4096)


class UnsealedBytes(PlainBytes):
    """Writes the payload and the trailer page as it found it, never calling
    ``seal``: a file of the right length holding a stale or empty trailer."""

    def write(
        self, fd: int, row: memoryview, trailer: memoryview, seal: Callable[[int | None], None]
    ) -> None:
        self._note("write")
        _pwrite_all(fd, row, 0)
        _pwrite_all(fd, trailer, row.nbytes)


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    # Into the row itself, never through a bytes object of our own: the
    # descriptor may be open with O_DIRECT (a disk), which takes only the
    # row's page-aligned memory (os.pread's fresh buffer fails EINVAL).
    done = 0
    while done < buf.nbytes:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if not n:
            break
        done += n
    return done
