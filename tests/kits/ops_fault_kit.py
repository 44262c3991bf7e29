"""Bad trees for the volume tools' tests (gc, stats, verify): directory
chains deeper than PATH_MAX, made and removed name by name as nothing else
can; a fault at one directory the moment a tool first opens or lists it; a
tool run as another user in a forked child; a nested ext4 that answers EIO.
No vLLM, no torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from llmkv_fs.cli import main as cli_main

PATH_MAX = 4096
LONG_NAME = "d" * 250  # NAME_MAX is 255: 20 levels of these pass PATH_MAX
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


LOCAL_FILESYSTEMS = ["ext4", "tmpfs"]


def local_dir(fs: str, tmp_path) -> Iterator[str]:
    """A fresh root on ext4 (pytest's tmp_path) or tmpfs (/dev/shm), for a
    ``local_root`` fixture: the faults here are made in this process, so a
    network filesystem adds nothing (and GlusterFS cannot even hold a tree
    deeper than PATH_MAX: its bricks answer such a mkdir ESTALE)."""
    if fs == "ext4":
        path = tmp_path / "kv"
        path.mkdir()
        yield str(path)
        return
    made = f"/dev/shm/llmkv_fs_test_{os.getpid()}_{tmp_path.name}"
    os.mkdir(made)
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def key_in_dir(directory: int, seed: str, group: int = 0) -> bytes:
    """A key whose block lies in fan-out directory number ``directory``
    (0 to 0xfffff): its hash's first five hex digits are ``<hhh><hh>``."""
    tail = hashlib.sha256(seed.encode()).hexdigest()[5:]
    return bytes.fromhex(f"{directory:05x}{tail}") + group.to_bytes(4, "big")


# -- chains deeper than PATH_MAX ------------------------------------------------------------


def deep_chain(parent: str, levels: int = 20, leaf_file: str | None = None) -> str:
    """``levels`` nested directories of 250-character names below
    ``parent``, each made with mkdir relative to its parent's fd, optionally
    a file ``leaf_file`` in the last. Returns the last one's path, a string
    no path-taking syscall accepts (longer than PATH_MAX)."""
    fd = os.open(parent, _DIR)
    try:
        for _ in range(levels):
            os.mkdir(LONG_NAME, dir_fd=fd)
            child = os.open(LONG_NAME, _DIR, dir_fd=fd)
            os.close(fd)
            fd = child
        if leaf_file is not None:
            made = os.open(leaf_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
            os.write(made, b"not a cache file\n")
            os.close(made)
    finally:
        os.close(fd)
    deepest = parent + f"/{LONG_NAME}" * levels
    assert len(deepest.encode()) > PATH_MAX
    return deepest


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Remove ``name`` (relative to ``dir_fd``) and all below it, name by
    name: what rmtree by path cannot do past PATH_MAX. Gone already: fine."""
    try:
        fd = os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    try:
        with os.scandir(fd) as it:
            entries = list(it)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                remove_tree_at(fd, entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def remove_chain(parent: str) -> None:
    fd = os.open(parent, _DIR)
    try:
        remove_tree_at(fd, LONG_NAME)
    finally:
        os.close(fd)


def depth_of_chain(parent: str) -> int:
    """How many chain levels are left below ``parent``."""
    depth, fd = 0, os.open(parent, _DIR)
    try:
        while True:
            try:
                child = os.open(LONG_NAME, _DIR, dir_fd=fd)
            except FileNotFoundError:
                return depth
            os.close(fd)
            fd, depth = child, depth + 1
    finally:
        os.close(fd)


# -- a fault at one directory ---------------------------------------------------------------


class DirFault:
    """The ``on_access``-th time this process opens or lists directory
    ``target`` (by path, or by name relative to a directory fd), ``act``
    runs first. An act that changes the tree for real (the directory swapped
    for a symlink or a file, or removed) makes the tool's own call fail as
    the kernel answers it; one that raises stands for an error no local
    filesystem gives on demand (ESTALE from an NFS server, EIO from a
    failing disk). ``after_listing``: ``act`` runs once the directory has
    been read, before the tool looks at its entries (a file removed
    between a listing and its lstat)."""

    def __init__(
        self,
        monkeypatch,
        target: str,
        act: Callable[[str], None],
        on_access: int = 1,
        after_listing: bool = False,
    ) -> None:
        self.target = target
        self.act = act
        self.on_access = on_access
        self.after_listing = after_listing
        self.accesses = 0
        self.fired = False
        self._lock = threading.Lock()
        real_open, real_scandir = os.open, os.scandir

        def fake_open(path, flags, mode=0o777, *, dir_fd=None):
            if not after_listing and self._names_target(path, dir_fd):
                self._access()
            return real_open(path, flags, mode, dir_fd=dir_fd)

        def fake_scandir(path="."):
            # An fd was counted when it was opened (unless after_listing).
            if isinstance(path, int):
                named = after_listing and os.readlink(f"/proc/self/fd/{path}") == target
            else:
                named = self._names_target(path, None)
            if not (named and after_listing):
                if named:
                    self._access()
                return real_scandir(path)
            with real_scandir(path) as it:
                entries = list(it)
            self._access()
            return contextlib.nullcontext(iter(entries))

        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "scandir", fake_scandir)

    def _names_target(self, path, dir_fd: int | None) -> bool:
        if not isinstance(path, str) or os.path.basename(path) != os.path.basename(self.target):
            return False
        if dir_fd is not None and not os.path.isabs(path):
            path = f"{os.readlink(f'/proc/self/fd/{dir_fd}')}/{path}"
        return os.path.normpath(path) == self.target

    def _access(self) -> None:
        with self._lock:
            self.accesses += 1
            if self.accesses != self.on_access:
                return
            self.fired = True
        self.act(self.target)


def moved_aside(path: str) -> str:
    return f"{os.path.dirname(os.path.dirname(path))}/.moved-{os.path.basename(path)}"


def swap_for_symlink(outside: str) -> Callable[[str], None]:
    def act(path: str) -> None:
        os.rename(path, moved_aside(path))
        os.symlink(outside, path)

    return act


def swap_for_file(path: str) -> None:
    os.rename(path, moved_aside(path))
    with open(path, "wb") as f:
        f.write(b"a file now\n")


def vanish(path: str) -> None:
    os.rename(path, moved_aside(path))


def raise_errno(code: int) -> Callable[[str], None]:
    def act(path: str) -> None:
        raise OSError(code, os.strerror(code), path)

    return act


# -- running a tool -------------------------------------------------------------------------


def tool(capsys, *argv: str) -> tuple[int, dict]:
    """``llmkv-fs <argv> --json`` in this process: (status, report)."""
    status = cli_main([*argv, "--json"])
    out = capsys.readouterr().out
    return status, json.loads(out) if out.strip() else {}


@contextlib.contextmanager
def reachable_root(base: str) -> Iterator[str]:
    """A fresh directory under ``base`` that other users can reach (pytest's
    tmp_path is root's, mode 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the tools as another user")
    path = f"{base}/llmkv_fs_faults_{os.getpid()}_{time.monotonic_ns():x}"
    os.mkdir(path)
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        for directory, dirs, _files in os.walk(path):
            for name in dirs:
                os.chmod(os.path.join(directory, name), 0o755, follow_symlinks=False)
        shutil.rmtree(path, ignore_errors=True)


def chown_tree(path: str, uid: int, gid: int) -> None:
    for directory, dirs, files in os.walk(path):
        os.chown(directory, uid, gid)
        for name in dirs + files:
            os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)


# -- a nested ext4 that fails ---------------------------------------------------------------

_EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
_EXT4_GOING_FLAGS_NOLOGFLUSH = 2


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def nested_ext4(mountpoint: str, image: str, size_mb: int = 8) -> Iterator[str]:
    """A small ext4 of our own mounted at ``mountpoint`` (an existing empty
    directory inside a cache tree). Skips without root or loop devices."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    made = _run(["mkfs.ext4", "-q", "-F", image])
    if made.returncode:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    done = _run(["mount", "-o", "loop", image, mountpoint])
    if done.returncode:
        pytest.skip(f"cannot loop-mount an ext4 image here: {done.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if _run(["umount", mountpoint]).returncode:
            _run(["umount", "-l", mountpoint])


def shut_down_ext4(path: str) -> None:
    """From now on the kernel answers opens, writes, unlinks and renames on
    the ext4 under ``path`` with EIO: what ext4 does when its disk fails."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


ESTALE, EIO = errno.ESTALE, errno.EIO
