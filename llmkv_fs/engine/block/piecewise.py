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
    before its write so the copy into the file reads it from cache; the
    trailer, packed with the digest, rides with the last piece. A failed
    write raises with the file incomplete (the caller removes it)."""
    hasher = xxhash.xxh3_64()
    done = 0
    last = row.nbytes - piece
    while done < last:
        part = row[done : done + piece]
        hasher.update(part)
        write_all(fd, [part], done)
        done += piece
    hasher.update(row[done:])
    pack_trailer(trailer, key, row.nbytes, hasher.intdigest(), created_ns)
    write_all(fd, [row[done:], trailer], done)
