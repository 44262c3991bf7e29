"""Vectored reads and writes of a whole block file that survive short
transfers: FUSE and NFS may split a large read or accept part of a large
write. Used by the engine's loads and stores and by ``llmkv-fs verify``;
stateless, so any thread may call them.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Container

__all__ = ["read_all", "write_all"]


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """The part of ``buffers`` left after the first ``n`` bytes."""
    while buffers and n >= buffers[0].nbytes:
        n -= buffers[0].nbytes
        buffers = buffers[1:]
    return [buffers[0][n:], *buffers[1:]] if n else buffers


def read_all(fd: int, buffers: list[memoryview], enough: Container[int] = ()) -> int:
    """Fill ``buffers`` from offset 0; returns the bytes read (short: EOF).

    Reads again after a short count until EOF or the buffers are full -- or
    at once when the count is in ``enough``: a regular file reads short only
    at its end, so where every valid file size is known one ``preadv``
    normally settles it, and asking again to be sure would cost a round trip
    on NFS. Only a count no valid file has -- which FUSE or NFS could produce
    by splitting a read -- is followed up before the file is judged bad.
    """
    done = os.preadv(fd, buffers, 0)
    while done > 0 and done not in enough:
        pending = _advance(buffers, done)
        if not pending:
            break
        n = os.preadv(fd, pending, done)
        if n == 0:
            break
        done += n
    return done


def write_all(fd: int, buffers: list[memoryview], offset: int = 0) -> None:
    """Loop ``pwritev`` from ``offset`` until every buffer is written."""
    while buffers:
        n = os.pwritev(fd, buffers, offset)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote 0 bytes")
        offset += n
        buffers = _advance(buffers, n)
