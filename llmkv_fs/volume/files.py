"""Creating files and directories on the shared volume with the configured
modes, whatever the process umask is; and opening what others put there.

Replicas of one deployment may run as different users of one group (a
Kubernetes fsGroup); a umask of 022 would silently strip the group write bit
they need, so modes are set explicitly with chmod after creation.

Everything on the volume is untrusted: anyone who can write it may plant a
symlink at a name we are about to create (our names carry host and pid,
which every lease publishes) or a FIFO where we expect a small file. So every
file we create is created new (``O_CREAT|O_EXCL|O_NOFOLLOW``, never
``O_TRUNC``: ``create_exclusive``), and every small file
we read by name is opened without following a link and without blocking,
then checked to be a regular file of a sane size (``read_small_regular_file``).
O_NOFOLLOW guards only a path's last component: a running tier resolves every
directory below its root through ``volume.beneath`` and uses the ``dir_fd``
forms here; the plain paths serve the root itself, the ops tools and tests.

And a whole block file's bytes, read or written in vectored calls that
survive short transfers (``read_all``, ``write_all``): FUSE and NFS may
split a large read or accept part of a large write. Stateless: any thread
may call them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import time
from collections.abc import Callable, Container
from typing import TypeVar

from llmkv_fs.layout.names import temp_name

__all__ = [
    "CHMOD_BITS",
    "DEFAULT_DIR_MODE",
    "DEFAULT_FILE_MODE",
    "PROCESS_UMASK",
    "SHARED_FS_ATTEMPTS",
    "SMALL_FILE_LIMIT",
    "UnsafeFileError",
    "create_exclusive",
    "create_flags",
    "file_type",
    "make_dirs",
    "missing_or_stale",
    "needs_chmod",
    "pause_before_retry",
    "read_all",
    "read_small_regular_file",
    "read_small_regular_file_at",
    "retry_transient",
    "write_all",
    "write_file_atomically_at",
]

DEFAULT_FILE_MODE = 0o640
DEFAULT_DIR_MODE = 0o770
# Two GlusterFS clients creating one fresh directory at the same moment: the
# loser's mkdir or open in it fails for a moment with ESTALE, or its mkdir
# with EEXIST while isdir() still says no; and gc may prune an empty directory
# between our mkdir and our open (ENOENT). Eight attempts ride that out
# (docs/reliability.md, bug 2: 16 processes x 8 fresh directories through two
# clients) without looping forever on a real error.
SHARED_FS_ATTEMPTS = 8
_FIRST_PAUSE_S = 0.001
# Leases and config.json are a few KiB; a bigger file at such a name is not ours.
SMALL_FILE_LIMIT = 1 << 20
# Flags every file we create is opened with: a new inode or an error, never
# an existing file (or what a planted link points to) opened for writing.
_CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted at the name must not hang open() (it is then
# refused by the fstat check); it changes nothing for a regular file.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Opening a directory only to make an NFS client revalidate it; O_NOFOLLOW
# here would refuse a symlinked ancestor the caller chose, so it only must be
# a directory (and no link is ever followed to a file: see _READ_FLAGS).
_DIR_REVALIDATE_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC

_T = TypeVar("_T")


def _umask() -> int:
    # os.umask can only be read by setting it; done once, at import, before
    # any I/O thread exists.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


PROCESS_UMASK = _umask()
# The bits a create under this process's umask loses (the umask's, and the
# set-id and sticky bits): a mode holding any needs a chmod after creation.
CHMOD_BITS = PROCESS_UMASK | 0o7000


def needs_chmod(mode: int) -> bool:
    """Whether creating with ``mode`` under this process's umask loses bits
    (then a chmod after creation restores them): ``mode & CHMOD_BITS``."""
    return bool(mode & CHMOD_BITS)


def missing_or_stale(exc: OSError) -> bool:
    """ENOENT or ESTALE: the name is not there, or was removed through
    another client while this one still had it cached (GlusterFS and NFS
    answer ESTALE, not ENOENT). The one answer to "is it gone?": a block
    that is gone is a miss, a parent gone for a moment is retried (see
    SHARED_FS_ATTEMPTS), a directory gone takes no new file."""
    return isinstance(exc, FileNotFoundError) or exc.errno == errno.ESTALE


def retry_transient(
    operation: Callable[[], _T],
    recover: Callable[[OSError], object],
    transient: Callable[[OSError], bool] = missing_or_stale,
) -> _T:
    """``operation()``, tried up to SHARED_FS_ATTEMPTS times while it fails
    with an error ``transient`` accepts; ``recover(error)`` runs between
    attempts (re-create the parent, say), and from the third attempt on a
    pause that doubles from 1 ms (63 ms in all): a network filesystem's
    "moment" is a round trip, not a loop iteration. Any other error, and the
    last attempt's, propagates."""
    for attempt in range(SHARED_FS_ATTEMPTS - 1):
        try:
            return operation()
        except OSError as exc:
            if not transient(exc):
                raise
            recover(exc)
            pause_before_retry(attempt)
    return operation()


def pause_before_retry(attempt: int) -> None:
    """Between attempt ``attempt`` (from 0) and the next of an operation
    that failed transiently: nothing after the first, then a pause that
    doubles from 1 ms (63 ms in all over SHARED_FS_ATTEMPTS)."""
    if attempt:
        time.sleep(_FIRST_PAUSE_S * 2 ** (attempt - 1))


def _dir_race(exc: OSError) -> bool:
    # A parent vanished between two mkdirs (NotADirectoryError also stands
    # for EEXIST whose name is not yet a visible directory), or two clients
    # of a network filesystem creating one path at once left a stale handle.
    return isinstance(exc, NotADirectoryError) or missing_or_stale(exc)


def _ancestry(path: str) -> list[str]:
    # ``path`` and every ancestor, shallowest first (no root: may reach "/").
    chain = [path]
    while (parent := os.path.dirname(chain[-1])) != chain[-1]:
        chain.append(parent)
    return chain[::-1]


def make_dirs(path: str, dir_mode: int = DEFAULT_DIR_MODE) -> None:
    """``os.makedirs(path, exist_ok=True)``, giving every directory it creates
    exactly ``dir_mode``. Tries the leaf first (on a young cache the parent
    usually exists: one mkdir, plus a chmod if the umask strips bits) and
    walks up only on ENOENT. Safe against a concurrent creator or remover of
    any level: a level that appears meanwhile is fine, one removed meanwhile
    (gc pruning empty directories) is created again.

    By path: for the root itself (start-up), the ops tools and tests. A
    running tier creates below its root through ``volume.beneath``
    (``Beneath.open_dir(..., create=True)``), which never follows a link and
    never recreates the root."""
    levels = _ancestry(path)
    try:
        # Nothing to repair between attempts: the next one walks up again.
        retry_transient(lambda: _make_dir_chain(levels, dir_mode), lambda _exc: None, _dir_race)
    except OSError as exc:
        if not _dir_race(exc):
            raise
        os.makedirs(path, dir_mode, exist_ok=True)  # raise the real error


def _make_dir_chain(levels: list[str], dir_mode: int) -> None:
    index = len(levels) - 1
    while True:
        probe = levels[index]
        try:
            os.mkdir(probe, dir_mode)
        except FileExistsError:
            if not os.path.isdir(probe):
                raise NotADirectoryError(probe) from None
            break
        except FileNotFoundError:
            if index == 0:
                raise
            index -= 1
            continue
        if needs_chmod(dir_mode):
            os.chmod(probe, dir_mode)
        break
    for directory in levels[index + 1 :]:
        try:
            os.mkdir(directory, dir_mode)
        except FileExistsError:
            continue
        if needs_chmod(dir_mode):
            os.chmod(directory, dir_mode)


class UnsafeFileError(OSError):
    """A name on the volume holds something other than the regular file of
    a sane size we expected there: a symlink (never followed), a FIFO, a
    socket, a device, a directory, or a file too large to be ours."""


def create_flags(flags: int) -> int:
    """The flags ``create_exclusive`` opens with, for ``flags``."""
    return (flags & ~os.O_TRUNC) | _CREATE_FLAGS


def create_exclusive(
    path: str,
    flags: int,
    file_mode: int,
    replace_leftover: bool = False,
    dir_fd: int | None = None,
) -> int:
    """Create ``path`` (relative to ``dir_fd`` when given) as a new file:
    ``os.open`` with ``flags`` plus ``O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC``
    (``O_TRUNC`` dropped). Whatever already has the name -- a file, or a
    symlink planted there -- is never opened, so nothing is truncated and no
    link is followed (FileExistsError). With ``replace_leftover`` the name
    is this writer's own (host and pid in it): the entry there is unlinked
    -- a symlink itself, never its target -- and the create tried once more."""
    flags = create_flags(flags)
    try:
        return os.open(path, flags, file_mode, dir_fd=dir_fd)
    except FileExistsError:
        if not replace_leftover:
            raise
    os.unlink(path, dir_fd=dir_fd)
    return os.open(path, flags, file_mode, dir_fd=dir_fd)


def file_type(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in one word (``file`` for a
    regular one): the words the reports and errors use."""
    for test, name in (
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "char-device"),
        (stat.S_ISBLK, "block-device"),
        (stat.S_ISDIR, "directory"),
    ):
        if test(mode):
            return name
    return "file"


def read_small_regular_file(
    path: str, limit: int = SMALL_FILE_LIMIT
) -> tuple[bytes, os.stat_result]:
    """``read_small_regular_file_at`` of ``path``'s name in its parent
    directory, which is opened by path (a symlinked ancestor is the
    caller's choice; the file itself is never reached through a link).

    The parent is opened for reading, not just resolved, so that a name
    another client replaced is not answered from this client's cache: that
    open makes an NFS client fetch the directory's attributes
    (close-to-open), which drops cached lookups under it, so the open of the
    name resolves it again. Without it, a config.json renamed over on client
    A while the old one was still open there read as the old bytes on client
    B for ~30 s (acdirmin; measured, docs/reliability.md). One extra open,
    on local filesystems a few microseconds; for files read rarely (config,
    leases)."""
    directory, name = os.path.split(path)
    try:
        dir_fd = os.open(directory or ".", _DIR_REVALIDATE_FLAGS)
    except PermissionError:  # searchable, not listable: resolve it only
        dir_fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return read_small_regular_file_at(dir_fd, name, limit, path)
    finally:
        os.close(dir_fd)


def read_small_regular_file_at(
    dir_fd: int, name: str, limit: int = SMALL_FILE_LIMIT, shown: str | None = None
) -> tuple[bytes, os.stat_result]:
    """The content and fstat of the regular file ``name`` in the directory
    open as ``dir_fd``, read without following a symlink, without blocking
    on a FIFO, and only if it holds at most ``limit`` bytes. Raises
    UnsafeFileError for anything else at the name, FileNotFoundError when
    nothing is there, OSError otherwise (``shown`` names it in errors). The
    fstat is the open file's, so fresh on NFS too (a lease's heartbeat)."""
    shown = name if shown is None else shown
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(errno.ELOOP, "a symlink, not followed", shown) from None
        if exc.errno == errno.ENXIO:  # a socket (or a FIFO on some systems)
            raise UnsafeFileError(errno.ENXIO, "not a regular file", shown) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(
                errno.EINVAL, f"not a regular file ({file_type(st.st_mode)})", shown
            )
        if st.st_size > limit:
            raise UnsafeFileError(errno.EFBIG, f"{st.st_size} bytes, over {limit}", shown)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # grew after the fstat
            raise UnsafeFileError(errno.EFBIG, f"over {limit} bytes", shown)
    finally:
        os.close(fd)
    return b"".join(chunks), st


def write_file_atomically_at(
    dir_fd: int,
    name: str,
    data: bytes,
    file_mode: int = DEFAULT_FILE_MODE,
    durable: bool = True,
) -> None:
    """Publish ``data`` as ``name`` in the directory open as ``dir_fd`` by
    temp file + rename, both relative to that descriptor: readers see the
    old file or the whole new one, and nothing is created or renamed
    anywhere else. The temp name carries host and pid (gc tells a crashed
    writer's leftover from a live one's) and a nonce; it is created new
    (no link followed, nothing truncated)."""
    nonce = os.urandom(6).hex()  # unique even for two writers in one process
    tmp = temp_name(name, socket.gethostname(), os.getpid(), nonce)
    fd = create_exclusive(tmp, os.O_WRONLY, file_mode, dir_fd=dir_fd)
    try:
        if needs_chmod(file_mode):
            os.fchmod(fd, file_mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
        # Forgotten before the close: a close that fails (NFS reports a lost
        # writeback there) has released the number all the same.
        closing, fd = fd, -1
        os.close(closing)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


# -- whole block files ---------------------------------------------------------


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
