"""How a sealed block's bytes move (``seal_key_files``): what the vectored
calls and the xxh3 checksum do for a plain one, with AES-256-GCM instead
(layout/sealed.py has the format and the reasons). ``BlockContents``
(block/contents.py) hands a block to it in place of its plain write and
read when its options say ``sealed``, in I/O threads and worker processes alike; every other check
around it (resolving beneath the root, temp file and rename, quarantine,
stamps) stays ``BlockIO``'s.

Store: the row is the CPU tier's own copy and must not change, so each piece
of it (``IoOptions.seal_piece``: a whole block in I/O threads, 256 KiB in
worker processes) is encrypted into a per-thread page-aligned buffer of that
size and written from there at its offset; then the trailer with the tag.
Load: the trailer first (its nonce, key id and tag are needed before the
first byte can be opened, and its read tells a short or long file at once),
then each piece is read into the row and decrypted there in place, right
after it lands (a worker's piece still in cache), and the tag is checked at
the end. A block that fails is zeroed in the row: not a byte of it,
ciphertext or unauthenticated plaintext, stays in the CPU tier.

In place: ``update_into(row, row)`` (OpenSSL underneath) decrypts in the
buffer it reads from, the cheapest of the cipher's calls: no second buffer,
no allocated result (docs/benchmarks.md, "Figures behind the code").
``update_into`` must release the GIL, which it does from cryptography 50
on, hence the floor in pyproject.toml.

Threading: one per root and process, shared by that process's I/O threads;
the store buffer is per thread. Methods block on the filesystem.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.layout.blockfile import TRAILER_SIZE, length_fault
from llmkv_fs.layout.sealed import Keyring, begin_open, begin_seal, end_open, end_seal
from llmkv_fs.volume.files import write_all

__all__ = ["SealedBytes"]


class SealedBytes:
    """See the module doc. ``place`` is the root's rank directory name (the
    block's place in the associated data: layout/sealed.py)."""

    def __init__(self, options: IoOptions, keyring: Keyring, place: str):
        self._keyring = keyring
        self._place = place.encode("utf-8", "surrogateescape")
        self._size = options.block_size
        self._piece = min(options.seal_piece or options.block_size, options.block_size)
        self._local = threading.local()

    def _buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            # Page aligned: a descriptor opened with O_DIRECT writes from it.
            buf = self._local.buf = memoryview(mmap.mmap(-1, self._piece))
        return buf

    def write(self, fd: int, key: bytes, row: memoryview, trailer: memoryview) -> None:
        """Seal ``row`` into the new file open as ``fd``: ciphertext at
        offset 0, then ``trailer`` (filled here). Raises OSError."""
        size = row.nbytes
        encryptor, tag_at = begin_seal(
            self._keyring, self._place, trailer, key, size, time.time_ns()
        )
        out = self._buffer()
        for done in range(0, size, out.nbytes):
            part = row[done : done + out.nbytes]
            n = encryptor.update_into(part, out)
            write_all(fd, [out[:n]], done)
        end_seal(encryptor, trailer, tag_at)
        write_all(fd, [trailer], size)

    def read(self, fd: int, key: bytes, row: memoryview, tail: memoryview) -> None:
        """Open the block in the file open as ``fd`` into ``row``; ``tail``
        is two pages of scratch (one more than the trailer, so a longer file
        shows). Returns only with ``row`` authenticated; raises
        BlockFileError, ForeignKey (layout/sealed.py) or OSError, the row
        then zeroed."""
        try:
            self._read(fd, key, row, tail)
        except BaseException:
            row[:] = bytes(row.nbytes)
            raise

    def _read(self, fd: int, key: bytes, row: memoryview, tail: memoryview) -> None:
        size = self._size
        n = os.preadv(fd, [tail], size)
        if n != TRAILER_SIZE:
            whole = size + n if n else os.fstat(fd).st_size
            raise length_fault(whole, size, trailerless=False)
        decryptor, tag = begin_open(self._keyring, self._place, tail[:TRAILER_SIZE], key, size)
        done = 0
        while done < size:
            part = row[done : done + self._piece]
            got = os.preadv(fd, [part], done)
            if got == 0:  # shortened since its trailer was read
                raise length_fault(done, size, trailerless=False)
            part = part[:got]
            decryptor.update_into(part, part)
            done += got
        end_open(decryptor, tag)
