"""Moving a block's payload in pieces and hashing each piece while it is in
cache: on memory-backed volumes the copy is itself a memory pass, and
hashing the whole row before (store) or after (load) it would read the row
from memory a second time (docs/benchmarks.md, issue 12). Stateless: any
I/O thread or worker may call these.
"""

from __future__ import annotations

import os

import xxhash

from llmkv_fs.layout.blockfile import pack_trailer
from llmkv_fs.layout.vectored import write_all

__all__ = ["read_hashing", "write_hashing"]


def read_hashing(fd: int, row: memoryview, scratch: memoryview, piece: int) -> tuple[int, int]:
    """Read the payload into ``row`` ``piece`` bytes at a time, hashing each
    piece right after its read; the trailer pages ride along with the last
    piece (one syscall fewer). Returns (bytes read, xxh3-64 of the payload);
    a short read stops it (the caller judges the length, the digest is then
    meaningless)."""
    hasher = xxhash.xxh3_64()
    done = 0
    size = row.nbytes
    while done < size:
        end = done + piece
        if end >= size:
            n = os.preadv(fd, [row[done:], scratch], done)
            hasher.update(row[done : min(size, done + n)])
            return done + n, hasher.intdigest()
        n = os.preadv(fd, [row[done:end]], done)
        if n == 0:
            return done, hasher.intdigest()
        hasher.update(row[done : done + n])
        done += n
    return done, hasher.intdigest()


def write_hashing(
    fd: int, row: memoryview, piece: int, trailer: memoryview, key: bytes, created_ns: int
) -> None:
    """Write the payload ``piece`` bytes at a time, hashing each piece right
    after its write: the kernel's copy into the file has just pulled the
    piece from memory into this CPU's cache, so the hash reads it from cache
    (hashing first made the hash do the memory read, which the kernel's copy
    does with far more reads in flight: 2 MiB blocks on the 16-core machine,
    docs/bench/device/issue20_store.md). The trailer, packed with the
    digest, follows in its own write. A failed write raises with the file
    incomplete (the caller removes it)."""
    hasher = xxhash.xxh3_64()
    size = row.nbytes
    for done in range(0, size, piece):
        part = row[done : done + piece]
        write_all(fd, [part], done)
        hasher.update(part)
    pack_trailer(trailer, key, size, hasher.intdigest(), created_ns)
    write_all(fd, [trailer], size)
