"""What one block file holds, once ``BlockIO`` has it open: the row written
with its trailer (key, length, checksum) and checked for length before it
may be published; on a load, the row read back and checked against its
trailer (key, length, the payload's xxh3). The bytes move through the byte
path (block/bytepath.py) or, for sealed blocks (``options.sealed``),
through ``SealedBytes`` (block/sealed.py: AES-256-GCM where the checksum
would be). Where the file lives -- resolving beneath the root, the temp
file and its rename, quarantine, stamps -- is ``BlockIO``'s
(block/blockio.py).

Threading: one ``BlockContents`` per ``BlockIO`` (per root and process),
shared by every I/O thread of that process. It holds only immutable settings
and the byte path; the trailer and scratch pages are the calling thread's
own, passed in. Methods block on the filesystem.
"""

from __future__ import annotations

import errno
import os
import time

from llmkv_fs.engine.block.bytepath import BytePath, VectoredBytes
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.block.sealed import SealedBytes
from llmkv_fs.engine.outcomes import NoChecksum, Outcome
from llmkv_fs.layout.blockfile import TRAILER_SIZE, pack_trailer, payload_checksum
from llmkv_fs.layout.judgement import BlockRules, Judgement
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.sealed import Keyring

__all__ = ["BlockContents", "BytePathFault"]


class BytePathFault(OSError):
    """A byte path returned normally but left a file that is no block file
    (short, long, or never sealed): the store fails, nothing is published."""

    def __init__(self, detail: str):
        super().__init__(errno.EIO, detail)


class BlockContents:
    """One root's block contents, moved by ``byte_path`` (default:
    ``VectoredBytes`` of the options), or sealed with ``keyring``."""

    def __init__(
        self,
        layout: CacheLayout,
        options: IoOptions,
        byte_path: BytePath | None = None,
        keyring: Keyring | None = None,
    ):
        self.layout = layout
        self.options = options
        self._bytes = VectoredBytes(options) if byte_path is None else byte_path
        # Sealed blocks move through SealedBytes instead of the byte path
        # (block/sealed.py); options and keyring must agree, so no process
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
        ``trailer``, the thread's page), fsync it if the options say so, and
        check its length. BytePathFault for a file that is no block file."""
        if self._sealed is not None:
            self._sealed.write(fd, key, row, trailer)
        else:
            checksum = self.options.checksum
            sealed = False

            def seal(digest: int | None) -> None:
                nonlocal sealed
                if checksum and digest is None:
                    digest = payload_checksum(row)
                pack_trailer(trailer, key, row.nbytes, digest if checksum else None, time.time_ns())
                sealed = True

            self._bytes.write(fd, row, trailer, seal)
            if not sealed:  # the trailer page holds another block's trailer, or nothing
                raise BytePathFault(f"the byte path never sealed the trailer of {key.hex()}")
        if self.options.fsync_file:
            os.fsync(fd)
        # The temp file is as long as a block file (one fstat): a byte path
        # that returned normally after a short write must not get its file
        # published and counted written (it would only be caught on load).
        size = row.nbytes + TRAILER_SIZE
        got = os.fstat(fd).st_size
        if got != size:
            raise BytePathFault(f"the byte path left {got} bytes of {size} for {key.hex()}")

    # -- load ------------------------------------------------------------------

    def read(self, fd: int, key: bytes, row: memoryview, scratch: memoryview) -> Outcome:
        """Fill ``row`` from ``fd`` and check it: OSError from the read,
        BlockFileError for a bad file (ForeignKey: sealed with a key we
        do not hold, left alone). ``scratch``: the thread's two pages."""
        if self._sealed is not None:
            self._sealed.read(fd, key, row, scratch)
            return Outcome.VERIFIED
        n, digest = self._bytes.read(fd, row, scratch, self.valid_sizes)
        return self._check(key, row, scratch, n, digest)

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
