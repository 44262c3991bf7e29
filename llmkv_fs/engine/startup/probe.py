"""Whether the volume takes O_DIRECT: one aligned write to a probe file,
made once at start-up (tmpfs before 6.6, overlayfs and some FUSE/NFS mounts
refuse it with EINVAL). Stateless; runs on the constructing thread.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket

from llmkv_fs.engine.block.options import O_DIRECT
from llmkv_fs.layout.names import probe_name
from llmkv_fs.volume.beneath import Beneath
from llmkv_fs.volume.files import create_exclusive

__all__ = ["O_DIRECT", "probe_o_direct"]

_PAGE = mmap.PAGESIZE


def probe_o_direct(directory: str, root: str | None = None) -> bool:
    """Whether an aligned O_DIRECT write works in ``directory`` (tmpfs before
    6.6, overlayfs and some FUSE/NFS mounts refuse it with EINVAL). With
    ``root`` (the tier's rank directory) ``directory`` is resolved beneath it
    without following a link (``volume.beneath``): a rank directory swapped
    for a symlink is not probed (False).

    The probe's name carries host and pid, which every lease publishes, so
    it is created new (``create_exclusive``: no link followed, nothing
    truncated); what already has the name -- a dead predecessor's probe or a
    planted link -- is unlinked itself, never written through."""
    if not O_DIRECT:
        return False
    try:
        if root is None:
            dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            below = Beneath(root)
            dir_fd = below.open_dir(below.relative(directory))
    except OSError:
        return False
    try:
        return _probe_in(dir_fd)
    finally:
        os.close(dir_fd)


def _probe_in(dir_fd: int) -> bool:
    name = probe_name(socket.gethostname(), os.getpid())
    page = mmap.mmap(-1, _PAGE)
    try:
        fd = create_exclusive(name, os.O_WRONLY | O_DIRECT, 0o600, True, dir_fd)
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
            os.unlink(name, dir_fd=dir_fd)
