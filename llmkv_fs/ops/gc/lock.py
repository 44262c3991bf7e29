"""One gc at a time per volume: ``fcntl.lockf`` on ``<root>/.llmkv-gc.lock``.

``lockf`` is a POSIX record lock, which NFS (NLM / NFSv4 locks), CephFS,
Lustre (with ``flock`` or ``localflock`` mounts) and GlusterFS forward to
the server, so gc runs on different machines exclude each other; ``flock``
would be local-only on several of them. The lock file is gc's only file of
its own on the volume; it records who holds it so a second run can say so.

The lock file is shared by every user that runs gc on the volume (a CronJob
and a sidecar may run as different users of one group, a Kubernetes
fsGroup): it is created ``LOCK_FILE_MODE`` (0660) whatever the umask, in the
root directory's group; a lock file an older version created narrower is
widened by its owner. Whatever else holds the name -- a planted symlink or
FIFO -- is never followed or opened: it is unlinked and the lock file made
anew.

The lock file also serves as the volume's clock: block ages come from
mtimes/atimes the file server stamped, so gc compares them against a time
the server stamped too (``futimens(UTIME_NOW)`` then ``fstat``), which makes
client clock skew irrelevant.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import threading
import time

from llmkv_fs.layout.names import gc_lock_path
from llmkv_fs.volume.files import create_exclusive

__all__ = ["LOCK_FILE_MODE", "LockBusy", "VolumeLock"]

_POLL_S = 0.2
# Group read/write: every user of the volume's group can take the lock.
LOCK_FILE_MODE = 0o660
# O_NONBLOCK: a FIFO at the name must not hang open() (O_RDWR would not,
# but this way no special file ever decides how long we wait).
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_ATTEMPTS = 4


class LockBusy(Exception):
    """Another gc holds the volume's lock."""


class VolumeLock:
    def __init__(self, root: str):
        self.root = root
        self.path = gc_lock_path(root)
        self._fd: int | None = None

    def _open(self) -> int:
        """The lock file, opened read-write: the existing regular file, or a
        new one made shareable by the group. A symlink, FIFO or other
        special file at the name is unlinked (never followed) first."""
        for _attempt in range(_OPEN_ATTEMPTS):
            try:
                fd = os.open(self.path, _OPEN_FLAGS)
            except FileNotFoundError:
                try:
                    fd = create_exclusive(self.path, os.O_RDWR, LOCK_FILE_MODE)
                except FileExistsError:
                    continue  # another gc created it just now: open that one
                try:
                    self._share(fd, created=True)
                except BaseException:
                    os.close(fd)
                    raise
                return fd
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                self._remove_planted()
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    self._share(fd, created=False, st=st)
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            self._remove_planted()
        raise OSError(
            errno.EAGAIN, "the lock's name keeps being taken by something else", self.path
        )

    def _remove_planted(self) -> None:
        st = os.lstat(self.path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "a directory holds the lock's name", self.path)
        if not stat.S_ISREG(st.st_mode):
            os.unlink(self.path)  # the link or FIFO itself; a target is never touched

    def _share(self, fd: int, created: bool, st: os.stat_result | None = None) -> None:
        """Give the lock file mode 0660 and the root's group, as far as we
        may: when we created it, or own it (an older version made it 0640)."""
        if not created and (st is None or st.st_uid != os.geteuid()):
            return
        st = st or os.fstat(fd)
        with contextlib.suppress(OSError):
            root_gid = os.stat(self.root).st_gid
            if st.st_gid != root_gid:
                # Allowed to a member of the root's group; a setgid root
                # (Kubernetes volumes with fsGroup) gives it anyway.
                os.fchown(fd, -1, root_gid)
        if stat.S_IMODE(st.st_mode) != LOCK_FILE_MODE:
            with contextlib.suppress(OSError):
                os.fchmod(fd, LOCK_FILE_MODE)

    def acquire(self, wait: bool = False, stop: threading.Event | None = None) -> bool:
        """Take the lock. Without ``wait`` raise LockBusy if it is held;
        with it, poll until it is free (False if ``stop`` is set first)."""
        fd = self._open()
        stopped = False
        try:
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                if not wait:
                    raise LockBusy(
                        f"another gc holds {self.path} ({self._holder(fd)}); "
                        "not running (pass --wait to wait for it)"
                    )
                if stop is not None and stop.wait(_POLL_S):
                    stopped = True
                    break
                if stop is None:
                    time.sleep(_POLL_S)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        if stopped:
            os.close(fd)
            return False
        note = f"host={socket.gethostname()} pid={os.getpid()} since={time.time():.0f}\n"
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
            # An NFS client sends cached writes at close or fsync only: without
            # this, a gc refused on another client read an empty note
            # ("holder unknown", tests/ops/gc/test_command.py on NFS v4.2).
            os.fsync(fd)
        self._fd = fd
        return True

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        except OSError:
            text = ""
        return text or "holder unknown"

    def volume_now(self) -> float:
        """The file server's idea of now (falls back to this machine's)."""
        if self._fd is None:
            return time.time()
        try:
            os.utime(self._fd)
            return os.fstat(self._fd).st_mtime
        except OSError:
            return time.time()

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing drops the lockf lock

    def __enter__(self) -> VolumeLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
