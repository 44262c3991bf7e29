"""One system call to open a name below a directory descriptor without
following any symlink on the way: Linux's ``openat2`` (5.6+) with
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV``, which Python's
``os`` does not wrap, called through ctypes.

``volume.beneath`` walks a path one component at a time for the same
guarantee: an ``open`` and a ``close`` per directory level, three levels
per block (``<rank>/<hhh>/<hh>_g<g>``), on every store, load and lookup.
Here the kernel walks the path once, refusing a link anywhere in it
(``ELOOP``), a ``..`` that would leave the directory or a mount point on
the way -- another filesystem, or a bind mount, planted inside the tree
(``EXDEV``) -- and resolving nothing outside it. A failure carries no more
than its errno, so callers use this for the common case only and take the
walk, which names what went wrong (``LinkInTree``, a missing level, a
replaced root), whenever the call fails in a way they do not settle
themselves (docs/benchmarks.md, "Small blocks": syscalls per block).

``AVAILABLE`` is False where the kernel or the C library lacks it (then
only the walk is used). Stateless: any thread may call ``open_beneath``;
it releases the GIL for the system call, as ``os.open`` does.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Callable

__all__ = ["AVAILABLE", "open_beneath"]

_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
# The system call's number: the same on every architecture since it was
# added (5.6, from the generic table), but only where Linux numbers it so.
_SYS_OPENAT2 = 437
_ARCHES = frozenset(("x86_64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x"))


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


def _load() -> Callable[..., int] | None:
    if platform.system() != "Linux" or platform.machine() not in _ARCHES:
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)
    return call


_syscall = _load()
_HOW_SIZE = ctypes.sizeof(_OpenHow)
# One open_how per set of flags, made once and kept (read-only to the
# kernel): none is built per call (docs/benchmarks.md, "Figures behind the
# code", has what one per call costs).
_HOWS: dict[tuple[int, int], tuple[_OpenHow, int]] = {}


def _how(flags: int, mode: int) -> int:
    held = _HOWS.get((flags, mode))
    if held is None:
        resolve = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_XDEV
        how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
        held = _HOWS[flags, mode] = (how, ctypes.addressof(how))
    return held[1]


def open_beneath(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """``path`` (relative, "/"-separated) opened below ``dir_fd`` with
    ``flags`` (``mode`` with ``O_CREAT``), never through a symlink, never
    across a mount point and never outside ``dir_fd``'s directory. Raises
    OSError with the call's errno: ENOENT, ELOOP (a symlink anywhere on the
    path, the last component included), ENOTDIR, EXDEV (a mount point on the
    path; ``path`` never holds ``..``), ENOSYS (no openat2), ..."""
    if _syscall is None:
        raise OSError(errno.ENOSYS, "openat2 is not available", path)
    name = path.encode("utf-8", "surrogateescape")
    fd = _syscall(_SYS_OPENAT2, dir_fd, name, _how(flags, mode), _HOW_SIZE)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return int(fd)


def _works() -> bool:
    """openat2 answers here (a kernel older than 5.6, or a seccomp filter of
    a container runtime, answers ENOSYS or EPERM)."""
    top = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.close(open_beneath(top, ".", os.O_PATH))
    except OSError:
        return False
    finally:
        os.close(top)
    return True


AVAILABLE = _syscall is not None and _works()
