"""Resolving names below the cache root without ever following a symlink:
the one place the tier (and its worker processes) turns a path below the
root into a directory descriptor.

Everything below root_dir is untrusted (docs/reliability.md). Anyone who can
write the volume may replace a directory of the tree -- a digest or rank
directory, an ``<hhh>`` or ``<hh>_g<g>`` fan-out directory, ``leases/``,
``.quarantine`` -- with a symlink to a directory elsewhere. A path handed to
the kernel whole follows such a link in its middle (``O_NOFOLLOW`` guards
the last component only), so a store would make directories, a temp file
and a block file outside the root, and a quarantine would move a file out of
the directory the link points to. Where Linux's ``openat2`` cannot answer
(below), the same guarantee comes from walking the path one
component at a time, each opened relative to its parent's descriptor with
``O_NOFOLLOW|O_DIRECTORY``: a symlink anywhere below the root stops the walk
(``LinkInTree``), and every mkdir, open, rename, unlink, stat and utime is
then made relative to the descriptor the walk returns (``dir_fd=``).

Another filesystem mounted inside the tree (a tmpfs, or anything bind-mounted
at a fan-out directory) is not the root's either: ``openat2`` refuses to
cross a mount point (``RESOLVE_NO_XDEV``), the walk compares each level's
``st_dev`` with the root's, and either way the level is ``MountInTree`` (a
LinkInTree: a miss, a refused store). A bind mount of the root's own
filesystem has the root's ``st_dev``: where ``openat2`` works, a directory
the creating walk made or found is opened once more in one call to be sure;
without it (or where the call cannot answer: EAGAIN, a sandbox's ENOSYS or
EPERM), only another device is seen.

One call where the kernel can: ``openat2`` with ``RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`` (``open_beneath``, below) gives the same guarantee for a
whole path in one system call instead of an open and a close per level, so
a directory known to exist and a block's file are opened that way first;
whatever that call cannot settle (a missing level to make, a link to name,
a replaced root, NFS revalidation) takes the walk.

Descriptors: the walk opens with ``O_PATH`` (no open call into the file
system, so no close-to-open round trip per level on NFS; a caller that wants
that revalidation asks for a real open of the last level). The root's
descriptor is kept, one per thread, checked once against the pinned
``(st_dev, st_ino)``; everything below it is resolved again by every
operation. Caching deeper descriptors would not pay: a block's fan-out
directories are one of ~10^6 per group, and proving a cached rank directory
still sits at its name (gc may rename it aside) costs an ``fstatat``, as much
as the open and close it saves (measured; docs/reliability.md). So a
directory gc removed or renamed aside is never written through later.

The single steps -- one level opened or made relative to its parent
(``open_child_dir``, ``make_dir_at``), and the errors ``LinkInTree`` and
``MountInTree`` -- come first below; the volume tools (gc, stats, verify)
and the ops-side quarantine walk their tops with them directly, with
``open_path_beneath`` for a top they listed by path. They are stateless:
any thread may call them; the descriptors returned are the caller's to
close.

Threading: one Beneath may be shared by any number of threads; each thread
opens its own root descriptor (``threading.local``), closed when the thread
ends or the Beneath is collected. Worker processes build their own.

The one-call form: Linux's ``openat2`` (5.6+) with ``RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV``, which Python's ``os`` does not
wrap, called through ctypes (``open_beneath``). The kernel walks the path
once, refusing a link anywhere in it (``ELOOP``), a ``..`` that would leave
the directory or a mount point on the way (``EXDEV``), and resolving
nothing outside it. Its failure carries no more than an errno, so it serves
the common case only and the walk, which names what went wrong, takes every
failure it does not settle. ``OPENAT2`` is False where the kernel or the C
library lacks it, or a seccomp filter refuses it (then only the walk runs).
Stateless: any thread may call ``open_beneath``; it releases the GIL for
the system call, as ``os.open`` does.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import threading
from collections.abc import Callable

from llmkv_fs.volume.files import (
    CHMOD_BITS,
    DEFAULT_DIR_MODE,
    SHARED_FS_ATTEMPTS,
    missing_or_stale,
    pause_before_retry,
)
from llmkv_fs.volume.pinned_root import PinnedRoot, parts_below

__all__ = [
    "ALREADY_THERE",
    "DIR_FLAGS",
    "MADE_HERE",
    "OPENAT2",
    "OPEN_DIR_FLAGS",
    "Beneath",
    "LinkInTree",
    "MountInTree",
    "make_dir_at",
    "open_beneath",
    "open_child_dir",
    "open_path_beneath",
]

# A directory to resolve names in: no read permission needed, no open call
# into the filesystem; O_NOFOLLOW|O_DIRECTORY fail on a link (ENOTDIR).
DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A directory really opened: fsync, fchmod, listing, NFS close-to-open.
OPEN_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
AT_FDCWD = -100  # openat's "relative to the current directory" (Linux)


class LinkInTree(OSError):
    """A symlink where a directory of the cache tree belongs (below the
    root): never followed. errno ELOOP, so it keeps its meaning when it
    crosses a process boundary as a bare OSError."""


class MountInTree(LinkInTree):
    """A mount point where a directory of the cache tree belongs: another
    filesystem (or a bind mount) inside the root, never crossed. Handled
    as a link everywhere (errno ELOOP, counted ``link_in_tree``)."""

    def __init__(self, shown: str):
        super().__init__(errno.ELOOP, "a mount point, not crossed", shown)


def open_child_dir(
    parent_fd: int, name: str, flags: int = DIR_FLAGS, shown: str = "", must_read: bool = False
) -> int:
    """The directory ``name`` in ``parent_fd`` opened with ``flags`` (which
    hold ``O_NOFOLLOW|O_DIRECTORY``). LinkInTree for a symlink there,
    NotADirectoryError for anything else that is not a directory,
    FileNotFoundError when nothing is (``shown``, else ``name``, names it
    in errors). A directory that may be searched but not read is resolved
    only (``O_PATH``) unless ``must_read`` (a listing): PermissionError."""
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except PermissionError:
        if flags == DIR_FLAGS or must_read:
            raise
        # Searchable but not readable (another uid's directory): resolve it
        # only. A real open was only wanted for NFS freshness or listing.
        return open_child_dir(parent_fd, name, DIR_FLAGS, shown)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
    # Which of the two: one lstat, on this rare path only.
    mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    shown = shown or name
    if stat.S_ISLNK(mode):
        raise LinkInTree(errno.ELOOP, "a symlink, not followed", shown)
    # A directory by now: another client's fresh mkdir became visible (a
    # caller creating retries that).
    raise NotADirectoryError(errno.ENOTDIR, "not a directory", shown)


# What make_dir_at answers when it hands back no descriptor (both < 0: the
# caller opens the directory): it was there already, or this call made it
# (then it is on its parent's device, no mount point).
ALREADY_THERE = -1
MADE_HERE = -2


def make_dir_at(parent_fd: int, name: str, dir_mode: int, shown: str = "") -> int:
    """mkdir ``name`` in ``parent_fd`` with exactly ``dir_mode``.
    ALREADY_THERE or MADE_HERE when the caller is to open it; a descriptor
    of it when making it needed a chmod (done through that descriptor: a
    chmod by name would follow a link swapped in meanwhile)."""
    try:
        os.mkdir(name, dir_mode, dir_fd=parent_fd)
    except FileExistsError:
        return ALREADY_THERE
    if not dir_mode & CHMOD_BITS:  # needs_chmod, without a call per directory made
        return MADE_HERE
    fd = open_child_dir(parent_fd, name, OPEN_DIR_FLAGS, shown)
    try:
        os.fchmod(fd, dir_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_path_beneath(top: str, path: str) -> int:
    """A readable descriptor of the directory ``path``, which lies at or below
    ``top`` by its spelling: ``top`` opened by its path (a link there is
    refused too: LinkInTree), every component after it relative to the one
    before, never through a link. For the volume tools, which walk tops they
    listed a moment ago (a rank or digest directory) while live tiers write
    the volume; a running tier resolves beneath its pinned root (Beneath).
    ValueError when ``path`` is not ``top`` or below it."""
    if path != top and not path.startswith(top.rstrip("/") + "/"):
        raise ValueError(f"{path!r} is not below {top!r}")
    names = parts_below(top, path) if path != top else []
    fd = open_child_dir(AT_FDCWD, top, DIR_FLAGS if names else OPEN_DIR_FLAGS, must_read=True)
    shown = top.rstrip("/")
    for i, name in enumerate(names):
        shown = f"{shown}/{name}"
        flags = OPEN_DIR_FLAGS if i == len(names) - 1 else DIR_FLAGS
        try:
            child = open_child_dir(fd, name, flags, shown, must_read=True)
        finally:
            os.close(fd)
        fd = child
    return fd


# -- the one call: openat2 ------------------------------------------------------------

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


OPENAT2 = _syscall is not None and _works()

# The root itself may be reached through links above it (checked at start:
# prepare refuses a root that is a link; the pin decides it is the same one).
_ROOT_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_KNOWN_DIRS_MAX = 1 << 16  # directories remembered as existing (a few MiB)
_NOT_NAMES = frozenset(("", ".", ".."))  # components a relative path may not have
# openat2 answers that leave a bind mount unsettled, not the path wrong (the
# walk's st_dev check stands); EAGAIN is tried _UNSETTLED_TRIES times first.
_UNSETTLED = frozenset((errno.EAGAIN, errno.ENOSYS, errno.EPERM))
_UNSETTLED_TRIES = 3


def _mount_on_the_way(exc: OSError, shown: str) -> None:
    """``openat2``'s EXDEV for a path without ``..``: a mount point on it."""
    if exc.errno == errno.EXDEV:
        raise MountInTree(shown) from None


def _creation_race(exc: OSError) -> bool:
    # A parent removed meanwhile (gc pruning), a stale handle on a network
    # filesystem, or a name another client is creating right now. Never a
    # symlink: LinkInTree is final.
    return missing_or_stale(exc) or isinstance(exc, NotADirectoryError)


class _RootFd:
    """One thread's root descriptor and the root's device; closed with it
    (thread end, or the Beneath collected)."""

    __slots__ = ("dev", "fd")
    _close = staticmethod(os.close)  # still bound while the interpreter exits

    def __init__(self, fd: int, dev: int):
        self.fd = fd
        self.dev = dev

    def __del__(self) -> None:
        if self.fd < 0:
            return  # released
        try:
            self._close(self.fd)
        except Exception:  # closed already, or the interpreter is going
            pass


class Beneath:
    """``root_path`` as a directory descriptor, and the names below it
    resolved from there without following a link. ``pin``: the root the
    tier started on -- a descriptor is only used if it is that directory
    (RootLost otherwise), and no child of the root is created unless the
    path still names it. None: tools and tests, the path is the root."""

    def __init__(self, root_path: str, pin: PinnedRoot | None = None):
        self.path = root_path.rstrip("/") or "/"
        self.pin = pin
        self._local = threading.local()
        # Directories created or found by a creating walk: it opens them
        # first; others it makes first (a young cache makes most of its
        # fan-out directories: no failing open before each mkdir). Shared
        # by threads: single set operations are atomic under the GIL.
        self._known: set[str] = set()
        self.one_call = OPENAT2  # paths opened in one openat2 call where it works

    def relative(self, path: str) -> str:
        """``path`` (below the root by its spelling) relative to the root."""
        return "/".join(parts_below(self.path, path))

    def root_fd(self) -> int:
        """This thread's descriptor of the root (do not close it)."""
        return self._root().fd

    def root_dev(self) -> int:
        """The root's ``st_dev``: a name below it on another device is
        behind a mount point (MountInTree)."""
        return self._root().dev

    def _root(self) -> _RootFd:
        held: _RootFd | None = getattr(self._local, "root", None)
        if held is None:
            held = self._local.root = self._open_root()
        return held

    def release(self) -> None:
        """Close the calling thread's root descriptor, if it holds one (the
        next use opens the root again): a thread that stays alive -- the
        engine's owner after shutdown -- keeps none."""
        held: _RootFd | None = getattr(self._local, "root", None)
        if held is not None:
            del self._local.root
            held._close(held.fd)
            held.fd = -1

    def _open_root(self) -> _RootFd:
        try:
            fd = os.open(self.path, _ROOT_FLAGS)
        except OSError:
            if self.pin is None:
                raise
            raise self.pin.lost() from None
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if self.pin is not None and (st.st_dev, st.st_ino) != self.pin.ident:
            os.close(fd)
            raise self.pin.lost()
        return _RootFd(fd, st.st_dev)

    def _drop_removed_root(self, exc: OSError | None = None) -> bool:
        """Forget this thread's root descriptor if its directory was removed,
        or if a walk from it met ESTALE: an NFS server that lost the handle
        (a failover, a re-export) answers every lookup through it so, and
        kept, it would fail every later block too. The next use opens the
        path again, and the pin decides. Only on failures: one fstat."""
        held: _RootFd | None = getattr(self._local, "root", None)
        if held is None:
            return False
        if exc is None or exc.errno != errno.ESTALE:
            try:
                if os.fstat(held.fd).st_nlink:
                    return False
            except OSError:
                pass  # a descriptor that cannot even be stat'ed: open the path again
        del self._local.root
        return True

    def open_dir(
        self,
        rel: str,
        *,
        create: bool = False,
        dir_mode: int = DEFAULT_DIR_MODE,
        revalidate: bool = False,
        after_race: bool = False,
    ) -> int:
        """A descriptor of the directory ``rel`` (relative to the root, "/"
        separated; the caller closes it), every component opened relative to
        its parent, never through a link. ``O_PATH`` unless ``revalidate``
        (the last level really opened: NFS refetches its attributes; such a
        descriptor also serves fsync and listing).

        ``create``: missing levels are made with exactly ``dir_mode``; a
        level removed or not yet visible meanwhile is retried (see
        SHARED_FS_ATTEMPTS); ``after_race``: the caller met such a race
        itself (a directory gone under its descriptor): every level opened
        for real from the first attempt. Raises LinkInTree, NotADirectoryError,
        FileNotFoundError (without ``create``), RootLost, OSError."""
        parts = rel.split("/")
        if not _NOT_NAMES.isdisjoint(parts):
            raise ValueError(f"{rel!r} is not a plain relative path")
        if self.one_call and not (revalidate or after_race) and (not create or rel in self._known):
            try:
                return open_beneath(self.root_fd(), rel, DIR_FLAGS)
            except OSError as exc:
                _mount_on_the_way(exc, self._shown(rel))
                # else the walk says what is wrong, or makes what is missing
        last = OPEN_DIR_FLAGS if revalidate else DIR_FLAGS
        if not create:
            return self._walk(parts, last)
        return self._walk_creating_retried(parts, dir_mode, last, after_race)

    def open_file(self, rel: str, flags: int) -> int:
        """The file (or directory) ``rel`` below the root opened with
        ``flags`` in one ``openat2`` call, never through a link. Raises
        OSError on any failure with its errno alone -- ENOSYS where
        ``one_call`` is False -- so the caller decides what it settles and
        takes the walk (``open_dir`` and a relative open) for the rest --
        except a mount point on the way: MountInTree, final."""
        try:
            return open_beneath(self.root_fd(), rel, flags)
        except OSError as exc:
            _mount_on_the_way(exc, self._shown(rel))
            raise

    def _shown(self, rel: str) -> str:
        return f"{self.path.rstrip('/')}/{rel}"

    @staticmethod
    def _same_device(fd: int, dev: int, name: str) -> None:
        """The walk's check of one level: on the root's device, or behind a
        mount point (one fstat per level; openat2 spares the common case)."""
        if os.fstat(fd).st_dev != dev:
            raise MountInTree(name)

    def _walk_creating_retried(
        self, parts: list[str], dir_mode: int, last: int, careful: bool
    ) -> int:
        """The creating walk and its bind-mount check (``_no_bind_mount``),
        again after a creation race in either (SHARED_FS_ATTEMPTS in all);
        a failed attempt closes its descriptor. Every retry opens each level
        for real: an ``O_PATH`` open trusts a dentry the network client still caches for a directory
        another client removed or re-made (no FUSE_OPENDIR, no NFS
        close-to-open GETATTR), so a walk that only resolves keeps handing
        out the same stale handle and the level below answers ESTALE every
        time (seen on GlusterFS, 16 processes on two clients creating fresh
        directories; and on NFS v3 after gc removed a writer's directory). A
        real open that meets a stale handle fails with ESTALE inside the
        kernel, which repeats that lookup revalidating (LOOKUP_REVAL), as it
        does for a whole path. ``careful``: so from the first attempt."""
        for attempt in range(SHARED_FS_ATTEMPTS - 1):
            try:
                return self._walk_creating_checked(parts, dir_mode, last, careful)
            except OSError as exc:
                if not _creation_race(exc):
                    raise
                careful = True
                self._drop_removed_root(exc)
                pause_before_retry(attempt)
        return self._walk_creating_checked(parts, dir_mode, last, careful)

    def _walk_creating_checked(
        self, parts: list[str], dir_mode: int, last: int, careful: bool
    ) -> int:
        """One attempt of ``_walk_creating_retried``: its descriptor, closed
        if the bind-mount check fails."""
        if careful:
            fd = self._walk_creating(parts, dir_mode, OPEN_DIR_FLAGS, OPEN_DIR_FLAGS)
        else:
            fd = self._walk_creating(parts, dir_mode, last, DIR_FLAGS)
        if self.one_call:
            try:
                self._no_bind_mount("/".join(parts))
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _no_bind_mount(self, rel: str) -> None:
        """The creating walk's last check: ``rel`` opened once more in one
        ``openat2`` call, which sees a bind mount of the root's own device
        (the walk's ``st_dev`` check cannot). Returns when the path holds no
        mount point, or when the call cannot settle it here: EAGAIN still
        after a few tries (the kernel could not rule out a concurrent
        rename), ENOSYS or EPERM (a sandbox's filter); the walk's own check
        stands then. Raises MountInTree for a mount point; LinkInTree for a
        link swapped in since the walk; else the call's OSError naming the
        path -- ENOENT, ESTALE or ENOTDIR are a directory removed or replaced
        meanwhile (a creation race, walked again by the caller)."""
        for attempt in range(_UNSETTLED_TRIES):
            try:
                os.close(open_beneath(self.root_fd(), rel, DIR_FLAGS))
                return
            except OSError as exc:
                if exc.errno == errno.EAGAIN and attempt + 1 < _UNSETTLED_TRIES:
                    continue
                if exc.errno in _UNSETTLED:
                    return
                shown = self._shown(rel)
                _mount_on_the_way(exc, shown)
                if exc.errno == errno.ELOOP:
                    raise LinkInTree(errno.ELOOP, "a symlink, not followed", shown) from None
                exc.filename = shown
                raise

    def _walk(self, parts: list[str], last: int, again: bool = True) -> int:
        root = self._root()
        top = fd = root.fd
        final = len(parts) - 1
        i = 0
        try:
            for i, name in enumerate(parts):
                flags = last if i == final else DIR_FLAGS
                try:  # open_child_dir's first step, inline: once per level per block
                    child = os.open(name, flags, dir_fd=fd)
                except (NotADirectoryError, PermissionError):
                    child = open_child_dir(fd, name, flags)
                except OSError as exc:
                    # The root's child missing or stale: the root itself may
                    # be gone, or its descriptor stale.
                    if missing_or_stale(exc) and i == 0 and again and self._drop_removed_root(exc):
                        return self._walk(parts, last, again=False)
                    raise
                parent, fd = fd, child  # held as fd before the close: _failed closes it
                if parent != top:
                    os.close(parent)
                self._same_device(fd, root.dev, name)
        except BaseException as exc:
            self._failed(exc, fd, top, parts, i)
            raise
        return fd

    def _walk_creating(
        self, parts: list[str], dir_mode: int, last: int, middle: int = DIR_FLAGS
    ) -> int:
        root = self._root()
        top = fd = root.fd
        final = len(parts) - 1
        known = self._known
        prefix = ""
        i = 0
        try:
            for i, name in enumerate(parts):
                prefix = f"{prefix}/{name}" if i else name
                flags = last if i == final else middle
                child = ALREADY_THERE
                # Never made first at the top: a child of the root is made
                # only after checking that the root path is still ours.
                if i and prefix not in known:
                    child = make_dir_at(fd, name, dir_mode)
                # A level this walk made is on its parent's device; one it
                # found may be a mount point: one fstat, on a found level
                # only (docs/benchmarks.md has what one on every level costs).
                made = child != ALREADY_THERE
                if child < 0:
                    try:
                        child = open_child_dir(fd, name, flags)
                    except FileNotFoundError:
                        if i == 0 and self.pin is not None:
                            self.pin.check()
                        child = make_dir_at(fd, name, dir_mode)
                        made = child != ALREADY_THERE
                        if child < 0:
                            child = open_child_dir(fd, name, flags)
                parent, fd = fd, child  # held as fd before the close: _failed closes it
                if parent != top:
                    os.close(parent)
                if not made:
                    self._same_device(fd, root.dev, name)
                if len(known) >= _KNOWN_DIRS_MAX:
                    known.clear()
                known.add(prefix)
        except BaseException as exc:
            self._failed(exc, fd, top, parts, i)
            raise
        return fd

    def _failed(self, exc: BaseException, fd: int, top: int, parts: list[str], i: int) -> None:
        """A walk stopped at ``parts[i]``: close what it held and name the
        whole path in the error (the syscall only knew the last component)."""
        if fd != top:
            os.close(fd)
        if isinstance(exc, OSError) and exc.filename in (None, "", parts[i]):
            exc.filename = f"{self.path.rstrip('/')}/{'/'.join(parts[: i + 1])}"
