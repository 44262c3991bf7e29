"""What one block file holds, once ``BlockIO`` has it open: the row written
with its trailer (key, length, checksum); on a load, the row read back and
checked against its trailer (key, length, the payload's xxh3) by the rule
``llmkv-fs verify`` applies too (layout/judgement.py). Plain blocks move
here; sealed ones (``options.sealed``) through ``SealedBytes``
(block/sealed.py: AES-256-GCM where the checksum would be). Where the file
lives -- resolving beneath the root, the temp file and its rename,
quarantine, stamps -- is ``BlockIO``'s (block/blockio.py).

How the bytes move: one ``pwritev``/``preadv`` of row and trailer, or, on
memory filesystems (``IoOptions.hash_chunk``), the payload in pieces, each
hashed right after it lands: the kernel's copy has just pulled it into this
CPU's cache, so the hash reads it from there and the memory read is left to
the kernel's copy, which has far more reads in flight (docs/benchmarks.md).
The descriptor may be open with O_DIRECT (``options.use_o_direct``, a
disk): bytes move straight between the file and the page-aligned row or
trailer, never through a buffer of our own.

Threading: one ``BlockContents`` per ``BlockIO`` (per root and process),
shared by every I/O thread of that process. It holds only immutable
settings; the trailer and scratch pages are the calling thread's own,
passed in. Methods block on the filesystem.
"""

from __future__ import annotations

import os
import time

import xxhash

from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.block.sealed import SealedBytes
from llmkv_fs.engine.outcomes import NoChecksum, Outcome
from llmkv_fs.layout.blockfile import TRAILER_SIZE, pack_trailer, pack_trailer_of
from llmkv_fs.layout.judgement import BlockRules, Judgement
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.sealed import Keyring
from llmkv_fs.volume.files import read_all, write_all

__all__ = ["BlockContents"]


class BlockContents:
    """One root's block contents: plain, or sealed with ``keyring``."""

    def __init__(self, layout: CacheLayout, options: IoOptions, keyring: Keyring | None = None):
        self.layout = layout
        self.options = options
        size, piece = options.block_size, options.hash_chunk
        pieces = options.checksum and piece and size % piece == 0 and size > piece
        # 0: the payload and the trailer move in one vectored call; else the
        # payload moves in pieces of this many bytes, each hashed as it lands.
        self._piece = piece if pieces else 0
        # Sealed blocks move through SealedBytes (block/sealed.py); options
        # and keyring must agree, so no process
        # ever writes a plain block where sealed ones live, nor the reverse.
        if options.sealed != (keyring is not None):
            raise ValueError(f"sealed={options.sealed} with {keyring!r}: a keyring iff sealed")
        self._sealed = (
            None if keyring is None else SealedBytes(options, keyring, layout.rank_dir_rel)
        )
        # How a block read back is judged: the rule llmkv-fs verify applies
        # too (layout/judgement.py). SealedBytes applies its sealed half
        # piece by piece.
        self.rules = BlockRules(
            options.block_size,
            options.sealed,
            options.checksum,
            options.accept_trailerless,
            keyring,
            layout.rank_dir_rel.encode("utf-8", "surrogateescape"),
        )
        # The file sizes a reader accepts (with a trailer; without one too
        # if accept_trailerless).
        self.valid_sizes = self.rules.sizes

    # -- store -----------------------------------------------------------------

    def write(self, fd: int, key: bytes, row: memoryview, trailer: memoryview) -> None:
        """Fill the temp file ``fd`` with ``row`` and its trailer (packed in
        ``trailer``, the thread's page) and fsync it if the options say so.
        OSError from the volume; the caller removes the file."""
        if self._sealed is not None:
            self._sealed.write(fd, key, row, trailer)
        elif not self._piece:
            pack_trailer_of(trailer, key, row, self.options.checksum, time.time_ns())
            write_all(fd, [row, trailer])
        else:
            piece, size = self._piece, row.nbytes
            hasher = xxhash.xxh3_64()
            for done in range(0, size, piece):
                part = row[done : done + piece]
                write_all(fd, [part], done)
                hasher.update(part)
            pack_trailer(trailer, key, size, hasher.intdigest(), time.time_ns())
            write_all(fd, [trailer], size)
        if self.options.fsync_file:
            os.fsync(fd)

    # -- load ------------------------------------------------------------------

    def read(self, fd: int, key: bytes, row: memoryview, scratch: memoryview) -> Outcome:
        """Fill ``row`` from ``fd`` and check it: OSError from the read,
        BlockFileError for a bad file (ForeignKey: sealed with a key we
        do not hold, left alone). ``scratch``: the thread's two pages."""
        if self._sealed is not None:
            self._sealed.read(fd, key, row, scratch)
            return Outcome.VERIFIED
        if not self._piece:
            n = read_all(fd, [row, scratch], self.valid_sizes)
            return self._check(key, row, scratch, n, None)
        n, digest = self._read_pieces(fd, row, scratch)
        return self._check(key, row, scratch, n, digest)

    def _read_pieces(self, fd: int, row: memoryview, tail: memoryview) -> tuple[int, int]:
        """Each piece hashed right after its read, from cache; the trailer
        pages ride along with the last piece (one syscall fewer). A short
        read stops it (the caller judges the length; the digest is then
        meaningless). Returns the bytes read and the payload's xxh3-64."""
        piece, size = self._piece, row.nbytes
        hasher = xxhash.xxh3_64()
        done = 0
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

    def _check(
        self, key: bytes, row: memoryview, scratch: memoryview, n: int, digest: int | None
    ) -> Outcome:
        judged = self.rules.judge_plain(key, row, scratch[:TRAILER_SIZE], n, digest)
        # By identity: an Enum's own hash is Python code (engine/outcomes.py).
        if judged is Judgement.VERIFIED:
            return Outcome.VERIFIED
        if judged is Judgement.UNVERIFIED:
            return Outcome.UNVERIFIED
        raise NoChecksum(self.layout.block_path(key))
