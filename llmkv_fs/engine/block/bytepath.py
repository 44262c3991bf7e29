"""The byte path: how one block's bytes move between a row of the CPU tier
and its file, once the file is open. It is the seam for another way of
moving bytes (a compiled copy, io_uring): an implementation of ``BytePath``
is given to the engine (``FsEngine(byte_path=...)``), reaches I/O threads
and worker processes alike in the step's spec (block/spec.py), and inherits
every check, because none of them is its job. Before it runs, the step has
checked the deadline, the chunk index, whether the root is lost and the
space guard; ``BlockIO`` has resolved the block's directory beneath the
root without following a link and created the temp file (or opened the
block, never through a link). ``BlockContents`` (block/contents.py) packs
the trailer (length, key, checksum) through the ``seal`` it hands a write,
which the byte path calls before the trailer's bytes go out, and verifies
it after a read; ``BlockIO`` then renames, quarantines a bad file and notes
the access stamp.

What an implementation may choose is how the bytes move -- one vectored
call, pieces, another engine -- and whether it hashes the payload on the
way (where the bytes are in cache anyway). A digest it reports must be the
xxh3-64 of the bytes it put in (or took from) the row: it is what the
checksum is checked against (load) or what the trailer records (store).

``VectoredBytes`` is the byte path the engine uses: one ``pwritev``/
``preadv`` of row and trailer, or on memory filesystems pieces hashed right
after each one lands (see ``IoOptions.hash_chunk``).

The descriptor may be open with O_DIRECT (``options.use_o_direct``, a disk):
bytes must move straight between the file and the row or trailer, which
are page-aligned, never through a buffer of the implementation's own.

Threading: a byte path is built once per root and process (``kind(options)``)
and shared by every I/O thread of that process; it must keep no per-call
state of its own. Its methods block on the filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container
from typing import Protocol

import xxhash

from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.volume.vectored import read_all, write_all

__all__ = ["BytePath", "BytePathKind", "Seal", "VectoredBytes"]

# Fills the trailer page in place; given the payload's xxh3-64 when the byte
# path computed it, else None (then it is computed from the row if wanted).
Seal = Callable[[int | None], None]


class BytePath(Protocol):
    def write(self, fd: int, row: memoryview, trailer: memoryview, seal: Seal) -> None:
        """Write ``row`` at offset 0 of the new file open as ``fd``, then
        ``trailer`` right after it, calling ``seal`` once before any byte of
        ``trailer`` is written (it fills the page). Raises OSError on any
        failure; the caller removes the file."""
        ...

    def read(
        self, fd: int, row: memoryview, tail: memoryview, sizes: Container[int]
    ) -> tuple[int, int | None]:
        """Fill ``row``, then ``tail``, from offset 0 of the file open as
        ``fd``. Returns the bytes read (fewer: the file is shorter) and the
        xxh3-64 of ``row`` if computed on the way (None: the caller hashes
        it). A count in ``sizes`` (the valid file lengths) settles the read:
        no second call is needed to be sure of the end."""
        ...


# What a byte path is built from: the options of the root it serves. A
# class with that constructor is one; it must be importable by name in a
# worker process (it travels pickled in the worker's spec).
BytePathKind = Callable[[IoOptions], BytePath]


class VectoredBytes:
    """See the module doc. ``hash_chunk`` (from the options): 0 moves the
    payload and the trailer in one vectored call; otherwise the payload
    moves in pieces of that many bytes, each hashed right after it lands."""

    __slots__ = ("_piece",)

    def __init__(self, options: IoOptions):
        size, piece = options.block_size, options.hash_chunk
        pieces = options.checksum and piece and size % piece == 0 and size > piece
        self._piece = piece if pieces else 0

    def write(self, fd: int, row: memoryview, trailer: memoryview, seal: Seal) -> None:
        piece = self._piece
        if not piece:
            seal(None)
            write_all(fd, [row, trailer])
            return
        # The kernel's copy into the file has just pulled each piece from
        # memory into this CPU's cache, so hashing it next reads it from
        # cache; the memory read is left to the kernel's copy, which has far
        # more reads in flight than the hash (docs/benchmarks.md).
        hasher = xxhash.xxh3_64()
        size = row.nbytes
        for done in range(0, size, piece):
            part = row[done : done + piece]
            write_all(fd, [part], done)
            hasher.update(part)
        seal(hasher.intdigest())
        write_all(fd, [trailer], size)

    def read(
        self, fd: int, row: memoryview, tail: memoryview, sizes: Container[int]
    ) -> tuple[int, int | None]:
        piece = self._piece
        if not piece:
            return read_all(fd, [row, tail], sizes), None
        # Each piece hashed right after its read, from cache; the trailer
        # pages ride along with the last piece (one syscall fewer). A short
        # read stops it (the caller judges the length; the digest is then
        # meaningless).
        hasher = xxhash.xxh3_64()
        done = 0
        size = row.nbytes
        while done < size:
            end = done + piece
            if end >= size:
                n = os.preadv(fd, [row[done:], tail], done)
                hasher.update(row[done : min(size, done + n)])
                return done + n, hasher.intdigest()
            n = os.preadv(fd, [row[done:end]], done)
            if n == 0:
                break
            hasher.update(row[done : done + n])
            done += n
        return done, hasher.intdigest()
