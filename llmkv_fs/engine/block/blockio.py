"""Moving one block between a primary-tier row and its file.

Threading: a ``BlockIO`` is shared by every I/O thread. It holds only
immutable settings; the per-thread scratch pages live in ``threading.local``.
Callers run ``store``/``load``/``exists`` on I/O threads only -- they block
on the filesystem.

Zero copy: the payload goes straight between the caller's row (a slice of
the page-aligned primary mmap) and the file with ``pwritev``/``preadv``;
the trailer travels in the same syscall from a per-thread aligned page.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import mmap
import os
import socket
import stat
import threading
import time
from collections.abc import Callable

from llmkv_fs.engine.block.piecewise import read_hashing, write_hashing
from llmkv_fs.engine.block.tempfiles import TempFiles
from llmkv_fs.engine.outcomes import Abandoned, BlockMissing, NoChecksum, Outcome
from llmkv_fs.layout.blockfile import (
    ACCESS_STAMP_INTERVAL_S,
    TRAILER_SIZE,
    BlockFileError,
    Corruption,
    pack_trailer,
    payload_checksum,
    verify_block,
)
from llmkv_fs.layout.files import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    PinnedRoot,
    create_exclusive,
)
from llmkv_fs.layout.names import probe_path, temp_path
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.layout.quarantine import file_ident, move_to_quarantine
from llmkv_fs.layout.vectored import read_all, write_all

__all__ = ["Abandoned", "BlockIO", "BlockMissing", "IoOptions", "Outcome", "probe_o_direct"]

O_DIRECT = getattr(os, "O_DIRECT", 0)
_PAGE = mmap.PAGESIZE
_STAMP_MEMORY = 1 << 16  # paths remembered for stamp rate limiting


@dataclasses.dataclass(frozen=True)
class IoOptions:
    block_size: int
    use_o_direct: bool
    fsync_file: bool
    fsync_dir: bool
    checksum: bool
    accept_trailerless: bool = False
    file_mode: int = DEFAULT_FILE_MODE
    dir_mode: int = DEFAULT_DIR_MODE
    stamp_access: bool = True
    # Loads read and hash the payload in pieces of this many bytes (0: one
    # read, then one hash). On memory-backed volumes the read is a memcpy and
    # hashing each piece while it is still in cache saves most of the hash's
    # memory traffic; on disks one large read matters more.
    hash_chunk: int = 0
    # The root the tier started on: directories are created only below it
    # (None: anywhere, for tools and tests without a running tier).
    root: PinnedRoot | None = None
    # NFS clients keep a name they found missing "missing" for acdirmin..
    # acdirmax (30-60 s measured) after another client creates it; a miss is
    # then re-checked after opening the deepest directory on its path that
    # exists, which forces a GETATTR of that directory (close-to-open) and so
    # drops stale negative entries under it (docs/reliability.md, NFS).
    revalidate_misses: bool = False


def probe_o_direct(directory: str) -> bool:
    """Whether an aligned O_DIRECT write works in ``directory`` (tmpfs before
    6.6, overlayfs and some FUSE/NFS mounts refuse it with EINVAL).

    The probe's name carries host and pid, which every lease publishes, so
    it is created new (``create_exclusive``: no link followed, nothing
    truncated); what already has the name -- a dead predecessor's probe or a
    planted link -- is unlinked itself, never written through."""
    if not O_DIRECT:
        return False
    path = probe_path(directory, socket.gethostname(), os.getpid())
    page = mmap.mmap(-1, _PAGE)
    try:
        fd = create_exclusive(path, os.O_WRONLY | O_DIRECT, 0o600, replace_leftover=True)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        # Also when open() failed: a filesystem refusing O_DIRECT may do so
        # after creating the file. unlink never follows a link.
        with contextlib.suppress(OSError):
            os.unlink(path)


class BlockIO:
    def __init__(self, layout: CacheLayout, options: IoOptions):
        self.layout = layout
        self.options = options
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._local = threading.local()
        trailerless = (options.block_size,) if options.accept_trailerless else ()
        self._valid_sizes = frozenset((options.block_size + TRAILER_SIZE, *trailerless))
        self._temps = TempFiles(options, self._open_flags(os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        # The same pieces serve stores: hashing a piece just before writing
        # it saves a second pass over the row from memory.
        self._hash_in_pieces = bool(
            options.checksum
            and options.hash_chunk
            and options.block_size % options.hash_chunk == 0
            and options.block_size > options.hash_chunk
        )
        # path -> monotonic time of our last access stamp. Shared by the I/O
        # threads; single dict operations are atomic under the GIL, and a
        # lost update only costs one extra stamp.
        self._stamped: dict[str, float] = {}
        # Paths loaded since the last apply_access_stamps; bounded so a
        # stalled housekeeping thread cannot grow it without limit.
        self._stamp_queue: collections.deque[str] = collections.deque(maxlen=_STAMP_MEMORY)

    # -- per-thread scratch ------------------------------------------------

    def _scratch(self) -> memoryview:
        # Two pages: the trailer, plus one more so a read can tell a file
        # longer than payload + trailer from a correct one without fstat.
        scratch = getattr(self._local, "pages", None)
        if scratch is None:
            scratch = memoryview(mmap.mmap(-1, 2 * _PAGE))
            self._local.pages = scratch
            # The temp-name nonce: threading.get_native_id() is a gettid
            # syscall on every call, so it is taken once per thread.
            self._local.nonce = f"{threading.get_native_id():x}"
        return scratch

    def _open_flags(self, base: int) -> int:
        flags = base | os.O_NOFOLLOW | os.O_CLOEXEC
        return flags | O_DIRECT if self.options.use_o_direct else flags

    # -- queries -------------------------------------------------------------

    def exists(self, key: bytes) -> bool:
        """A regular file of a size our reader accepts is at the block's path
        (lstat: a planted symlink is not a block)."""
        path = self.layout.block_path(key)
        try:
            return self._is_block_file(path, missing_ok=False)
        except FileNotFoundError:
            if not self.options.revalidate_misses:
                return False
        self._revalidate_dirs(path)
        return self._is_block_file(path)

    def _is_block_file(self, path: str, missing_ok: bool = True) -> bool:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if missing_ok:
                return False
            raise
        return stat.S_ISREG(st.st_mode) and st.st_size in self._valid_sizes

    def _revalidate_dirs(self, path: str) -> None:
        """Open the deepest existing directory between ``path``'s parent and
        the rank directory (measured on NFS v4.2/v3 in an emulated guest: one
        open ~4.5 ms beside a 1.5 ms lstat; a block created on another client
        seen by the next check instead of ~30 s later)."""
        directory = os.path.dirname(path)
        stop = self.layout.rank_dir
        while True:
            try:
                os.close(os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
                return
            except OSError:
                if directory == stop or len(directory) <= len(stop):
                    return
                directory = os.path.dirname(directory)

    # -- store -----------------------------------------------------------------

    def store(
        self, key: bytes, row: memoryview, still_wanted: Callable[[], bool] | None = None
    ) -> Outcome:
        """Publish ``row`` as the block file of ``key``: temp file named after
        this writer, optional fsync, rename. Never leaves a partial file under
        the final name; removes its temp file on any failure.

        ``still_wanted`` is asked right before the rename: a job that passed
        its deadline meanwhile was already reported failed, and vLLM may have
        reused ``row``, so what was written must not be published (Abandoned).
        """
        opts = self.options
        path = self.layout.block_path(key)
        # access() answers "absent" without raising FileNotFoundError, the
        # common case here and measurably cheaper than lstat under the GIL.
        if os.access(path, os.F_OK, follow_symlinks=False) and self._is_block_file(path):
            return Outcome.PRESENT
        trailer = self._scratch()[:TRAILER_SIZE]
        tmp = temp_path(path, self._host, self._pid, self._local.nonce)
        fd = self._temps.create(tmp)
        try:
            try:
                if self._hash_in_pieces:
                    write_hashing(fd, row, opts.hash_chunk, trailer, key, time.time_ns())
                else:
                    checksum = payload_checksum(row) if opts.checksum else None
                    pack_trailer(trailer, key, row.nbytes, checksum, time.time_ns())
                    write_all(fd, [row, trailer])
                if opts.fsync_file:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if still_wanted is not None and not still_wanted():
                raise Abandoned(path)
            try:
                os.rename(tmp, path)
            except FileExistsError:
                # Some shared filesystems refuse to rename over an existing
                # name; names are content keys, so the file there is this block.
                os.unlink(tmp)
                return Outcome.PRESENT
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if opts.fsync_dir:
            self._fsync_dir(os.path.dirname(path))
        return Outcome.WRITTEN

    @staticmethod
    def _fsync_dir(directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- load ------------------------------------------------------------------

    def load(self, key: bytes, row: memoryview) -> Outcome:
        """Read the block of ``key`` into ``row`` and verify it.

        Raises BlockMissing, BlockFileError (the file is bad: it has been
        moved to quarantine when this returns) or OSError. On any raise the
        row holds garbage and must not be reported as loaded.
        """
        path = self.layout.block_path(key)
        scratch = self._scratch()
        try:
            # O_NONBLOCK: a FIFO planted at a block path must not hang an I/O
            # thread in open(); it fails in preadv instead (no effect on files).
            fd = os.open(path, self._open_flags(os.O_RDONLY | os.O_NONBLOCK))
        except FileNotFoundError as exc:
            raise BlockMissing(path) from exc
        except OSError as exc:
            if exc.errno == errno.ESTALE:  # removed through another client: see below
                raise BlockMissing(path) from exc
            if exc.errno == errno.ELOOP:  # a symlink planted at a block path
                link = BlockFileError(Corruption.SYMLINK, path)
                link.left_because = "a symlink is never followed nor moved"
                raise link from exc
            raise
        bad: BlockFileError | None = None
        try:
            try:
                if self._hash_in_pieces:
                    n, digest = read_hashing(fd, row, scratch, self.options.hash_chunk)
                else:
                    n, digest = read_all(fd, [row, scratch], self._valid_sizes), None
            except OSError as exc:
                # The file (or a directory above it) was removed through
                # another client -- gc on another node -- while this client
                # still had it cached: GlusterFS and NFS answer ESTALE, not
                # ENOENT. The block is gone: a clean miss (test_cross_client.py).
                if exc.errno == errno.ESTALE:
                    raise BlockMissing(path) from exc
                raise
            try:
                outcome = self._check(key, row, scratch, n, digest)
                if self.options.stamp_access:
                    self._stamp_access(path)
                return outcome
            except BlockFileError as exc:
                bad, ident = exc, file_ident(os.fstat(fd))
        finally:
            # A read-only descriptor: closing it can lose nothing, and a
            # GlusterFS client answers the close of a file removed through
            # another client with ESTALE (which would hide the outcome).
            with contextlib.suppress(OSError):
                os.close(fd)
        try:
            bad.quarantined_to = self.quarantine(path, bad.reason, ident)
            if bad.quarantined_to is None:
                bad.left_because = "the path names another file by now"
        except OSError as exc:
            # Still a bad file (counted as such); the engine remembers the
            # key as a miss so new requests do not re-read it.
            bad.left_because = f"could not be moved aside: {exc}"
        raise bad

    def _check(
        self, key: bytes, row: memoryview, scratch: memoryview, n: int, digest: int | None
    ) -> Outcome:
        opts = self.options
        if n == opts.block_size + TRAILER_SIZE:
            trailer = verify_block(row, scratch[:TRAILER_SIZE], key, opts.checksum, digest)
            if not opts.checksum:
                return Outcome.UNVERIFIED  # length and key checked, the payload not
            if trailer.has_checksum:
                return Outcome.VERIFIED
            # Written with checksum: false. Without a checksum a flipped bit
            # cannot be seen: like a trailer-less file, served only to a
            # reader that accepts unverified blocks. Not corrupt: left alone.
            if opts.accept_trailerless:
                return Outcome.UNVERIFIED
            raise NoChecksum(self.layout.block_path(key))
        if n == opts.block_size and opts.accept_trailerless:
            return Outcome.UNVERIFIED
        reason = Corruption.TRUNCATED if n < opts.block_size else Corruption.BAD_LENGTH
        raise BlockFileError(reason, f"{n} bytes, expected {opts.block_size + TRAILER_SIZE}")

    def _stamp_access(self, path: str) -> None:
        """Note this load for LRU eviction (see layout.blockfile.last_used),
        at most once per ACCESS_STAMP_INTERVAL_S per file and process. The
        stamp itself is a metadata write (a SETATTR round trip on NFS), so
        it is queued for ``apply_access_stamps`` off the load path."""
        now = time.monotonic()
        if now - self._stamped.get(path, -ACCESS_STAMP_INTERVAL_S) < ACCESS_STAMP_INTERVAL_S:
            return
        if len(self._stamped) >= _STAMP_MEMORY:
            self._stamped.clear()
        self._stamped[path] = now
        self._stamp_queue.append(path)

    def has_queued_stamps(self) -> bool:
        return bool(self._stamp_queue)

    def apply_access_stamps(self) -> int:
        """Set atime and mtime of every queued path to now (housekeeping
        thread). atime under relatime/noatime says nothing, hence explicit.
        "Now" for both needs only write permission or ownership; a replica
        of another uid without it simply can't stamp. Returns the count."""
        done = 0
        while self._stamp_queue:
            path = self._stamp_queue.popleft()
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to stamp
                os.utime(path, follow_symlinks=False)
                done += 1
        return done

    def quarantine(
        self, path: str, reason: str, ident: tuple[int, int] | None = None
    ) -> str | None:
        """Move a bad block file aside so no lookup finds it again, unless
        ``path`` names another file by now than the one we read (a writer
        republished it meanwhile). Returns the new path, or None."""
        try:
            return move_to_quarantine(
                path, self.layout.rank_dir, reason, ident, self.options.dir_mode, self.options.root
            )
        except FileNotFoundError:
            return None
