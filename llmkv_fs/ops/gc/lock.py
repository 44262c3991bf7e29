"""One gc at a time per volume: ``fcntl.lockf`` on ``<root>/.llmkv-gc.lock``.

``lockf`` is a POSIX record lock, which NFS (NLM / NFSv4 locks), CephFS,
Lustre (with ``flock`` or ``localflock`` mounts) and GlusterFS forward to
the server, so gc runs on different machines exclude each other; ``flock``
would be local-only on several of them. The lock file is gc's only file of
its own on the volume; it records who holds it so a second run can say so.

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
import threading
import time

from llmkv_fs.layout.names import gc_lock_path

__all__ = ["LockBusy", "VolumeLock"]

_POLL_S = 0.2


class LockBusy(Exception):
    """Another gc holds the volume's lock."""


class VolumeLock:
    def __init__(self, root: str):
        self.path = gc_lock_path(root)
        self._fd: int | None = None

    def acquire(self, wait: bool = False, stop: threading.Event | None = None) -> bool:
        """Take the lock. Without ``wait`` raise LockBusy if it is held;
        with it, poll until it is free (False if ``stop`` is set first)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o660)
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
                    os.close(fd)
                    return False
                if stop is None:
                    time.sleep(_POLL_S)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        note = f"host={socket.gethostname()} pid={os.getpid()} since={time.time():.0f}\n"
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
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
