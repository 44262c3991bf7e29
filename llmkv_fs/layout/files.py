"""Creating files and directories on the shared volume with the configured
modes, whatever the process umask is.

Replicas of one deployment may run as different users of one group (a
Kubernetes fsGroup); a umask of 022 would silently strip the group write bit
they need, so modes are set explicitly with chmod after creation.
"""

from __future__ import annotations

import errno
import os
import socket
import uuid

from llmkv_fs.layout.paths import temp_path

DEFAULT_FILE_MODE = 0o640
DEFAULT_DIR_MODE = 0o770


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


def make_dirs(path: str, dir_mode: int = DEFAULT_DIR_MODE) -> None:
    """``os.makedirs(path, exist_ok=True)``, giving every directory it creates
    exactly ``dir_mode``. Tries the leaf first (on a young cache the parent
    usually exists: one mkdir, plus a chmod if the umask strips bits) and
    walks up only on ENOENT. Safe against a concurrent creator or remover of
    any level: a level that appears meanwhile is fine, one removed meanwhile
    (gc pruning empty directories) is created again."""
    for _attempt in range(8):
        try:
            _make_dir_chain(path, dir_mode)
            return
        except (FileNotFoundError, NotADirectoryError):
            continue  # a parent vanished between two mkdirs: go again
        except OSError as exc:
            # Two clients of a network filesystem creating one path at once:
            # a stale handle, or EEXIST before the name's attributes arrive.
            if exc.errno != errno.ESTALE:
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


def create_in_dir(path: str, flags: int, file_mode: int, dir_mode: int, attempts: int = 8) -> int:
    """``os.open(path, flags, file_mode)``, creating the parent directories
    (``make_dirs``) first if needed. Retries when the parent is missing or
    stale right after it was made: gc may prune it, and another client of a
    network filesystem creating the same directory can leave this client a
    stale handle or a not-yet-visible entry for a moment."""
    for _attempt in range(attempts - 1):
        try:
            return os.open(path, flags, file_mode)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
        make_dirs(os.path.dirname(path), dir_mode)
    return os.open(path, flags, file_mode)


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
    fd = create_in_dir(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                       file_mode, dir_mode)
    try:
        if needs_chmod(file_mode):
            os.fchmod(fd, file_mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
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


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (from mountinfo), or ""."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                try:
                    mountpoint = fields[4].replace("\\040", " ")
                    kind = fields[fields.index("-") + 1]
                except (IndexError, ValueError):
                    continue
                inside = real == mountpoint or real.startswith(mountpoint.rstrip("/") + "/")
                if inside and len(mountpoint) >= len(best):
                    best, fstype = mountpoint, kind
    except OSError:
        return ""
    return fstype
