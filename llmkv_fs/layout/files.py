"""Creating files and directories on the shared volume with the configured
modes, whatever the process umask is.

Replicas of one deployment may run as different users of one group (a
Kubernetes fsGroup); a umask of 022 would silently strip the group write bit
they need, so modes are set explicitly with chmod after creation.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import uuid
from collections.abc import Callable
from typing import TypeVar

from llmkv_fs.layout.names import temp_path

__all__ = [
    "DEFAULT_DIR_MODE",
    "DEFAULT_FILE_MODE",
    "PROCESS_UMASK",
    "SHARED_FS_ATTEMPTS",
    "create_in_dir",
    "is_transient",
    "make_dirs",
    "needs_chmod",
    "read_revalidated",
    "retry_transient",
    "write_file_atomically",
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

_T = TypeVar("_T")


def read_revalidated(path: str) -> tuple[bytes, os.stat_result]:
    """A small file's bytes and fstat, read so that a name another client
    replaced is not answered from this client's cache: opening the parent
    directory first makes an NFS client fetch its attributes (close-to-open),
    which drops cached lookups under it, so the open below resolves the name
    again. Without it, a config.json renamed over on client A while the old
    one was still open there read as the old bytes on client B for ~30 s
    (acdirmin; measured, docs/reliability.md). One extra open, on local
    filesystems a few microseconds; for files read rarely (config, leases)."""
    with contextlib.suppress(OSError):
        os.close(os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    with open(path, "rb") as f:
        return f.read(), os.fstat(f.fileno())


def _umask() -> int:
    # os.umask can only be read by setting it; done once, at import, before
    # any I/O thread exists.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


PROCESS_UMASK = _umask()


def needs_chmod(mode: int) -> bool:
    """Whether creating with ``mode`` under this process's umask loses bits
    (then a chmod after creation restores them)."""
    return bool(mode & PROCESS_UMASK) or bool(mode & 0o7000)


def is_transient(exc: OSError) -> bool:
    """ENOENT or ESTALE: a parent missing or stale for a moment (see
    SHARED_FS_ATTEMPTS)."""
    return isinstance(exc, FileNotFoundError) or exc.errno == errno.ESTALE


def retry_transient(
    operation: Callable[[], _T],
    recover: Callable[[OSError], object],
    transient: Callable[[OSError], bool] = is_transient,
) -> _T:
    """``operation()``, tried up to SHARED_FS_ATTEMPTS times while it fails
    with an error ``transient`` accepts; ``recover(error)`` runs between
    attempts (re-create the parent, say). Any other error, and the last
    attempt's, propagates."""
    for _attempt in range(SHARED_FS_ATTEMPTS - 1):
        try:
            return operation()
        except OSError as exc:
            if not transient(exc):
                raise
            recover(exc)
    return operation()


def _dir_race(exc: OSError) -> bool:
    # A parent vanished between two mkdirs (NotADirectoryError also stands
    # for EEXIST whose name is not yet a visible directory), or two clients
    # of a network filesystem creating one path at once left a stale handle.
    return isinstance(exc, NotADirectoryError) or is_transient(exc)


def make_dirs(path: str, dir_mode: int = DEFAULT_DIR_MODE) -> None:
    """``os.makedirs(path, exist_ok=True)``, giving every directory it creates
    exactly ``dir_mode``. Tries the leaf first (on a young cache the parent
    usually exists: one mkdir, plus a chmod if the umask strips bits) and
    walks up only on ENOENT. Safe against a concurrent creator or remover of
    any level: a level that appears meanwhile is fine, one removed meanwhile
    (gc pruning empty directories) is created again."""
    try:
        # Nothing to repair between attempts: the next one walks up again.
        retry_transient(lambda: _make_dir_chain(path, dir_mode), lambda _exc: None, _dir_race)
    except OSError as exc:
        if not _dir_race(exc):
            raise
        os.makedirs(path, dir_mode, exist_ok=True)  # raise the real error


def _make_dir_chain(path: str, dir_mode: int) -> None:
    missing = []
    probe = path
    while True:
        try:
            os.mkdir(probe, dir_mode)
        except FileExistsError:
            if not os.path.isdir(probe):
                raise NotADirectoryError(probe) from None
            break
        except FileNotFoundError:
            parent = os.path.dirname(probe)
            if parent == probe:
                raise
            missing.append(probe)
            probe = parent
            continue
        if needs_chmod(dir_mode):
            os.chmod(probe, dir_mode)
        break
    for directory in reversed(missing):
        try:
            os.mkdir(directory, dir_mode)
        except FileExistsError:
            continue
        if needs_chmod(dir_mode):
            os.chmod(directory, dir_mode)


def create_in_dir(
    path: str, flags: int, file_mode: int, dir_mode: int, replace_leftover: bool = False
) -> int:
    """``os.open(path, flags, file_mode)``, creating the parent directories
    (``make_dirs``) first if needed. Retries when the parent is missing or
    stale right after it was made (see SHARED_FS_ATTEMPTS). With
    ``replace_leftover`` the name is this writer's own, so a file already
    there (O_EXCL) is a dead predecessor's and is removed first."""
    directory = os.path.dirname(path)

    def recover(exc: OSError) -> None:
        if isinstance(exc, FileExistsError):
            os.unlink(path)
        else:
            make_dirs(directory, dir_mode)

    def transient(exc: OSError) -> bool:
        return is_transient(exc) or (replace_leftover and isinstance(exc, FileExistsError))

    return retry_transient(lambda: os.open(path, flags, file_mode), recover, transient)


def write_file_atomically(
    path: str,
    data: bytes,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
    durable: bool = True,
) -> None:
    """Publish ``data`` at ``path`` by temp file + rename: readers see the old
    file or the whole new one. The temp name carries host and pid so gc can
    tell a crashed writer's leftover from a live one's."""
    nonce = uuid.uuid4().hex[:12]  # unique even for two writers in one process
    tmp = temp_path(path, socket.gethostname(), os.getpid(), nonce)
    fd = create_in_dir(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        file_mode,
        dir_mode,
    )
    try:
        if needs_chmod(file_mode):
            os.fchmod(fd, file_mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
