"""Whether a block's file is there: a regular file of a size our reader
accepts, at the block's path resolved beneath the root. Lookups ask it for
every key of a prompt (``BlockIO.exists``), mostly for blocks that are not
there. (A store that finds a file judges it itself: BlockIO.store.)

A symlink anywhere on the way, or at the name, is not a block; neither is a
file where a directory belongs. On NFS a miss is looked at again after
revalidating the directories above it (``IoOptions.revalidate_misses``): a
client keeps a name it found missing "missing" for up to acdirmax after
another client created it.

A batch of blocks (``many``, a lookup's chunk of keys) is checked by the
compiled module ``_presence`` (``_presence.c``) where it is built and
``openat2`` works: each key's path built, then the same one call, ``fstat``
and ``close``, in one C loop without the GIL, so a long prompt's checks do
not take the scheduler's interpreter lock for every key.
Whatever that loop cannot settle is decided here, key by key, as without
it. The module is optional (built by the package's install where a C
compiler is; see ``presence_path``), and the ``compiled_io`` setting off
(``IoOptions.compiled``) keeps the Python path (tests run both).

Threading: shared by the I/O and lookup threads of one BlockIO; it holds
only settings (descriptors are the Beneath's, per thread). Blocks on the
filesystem.
"""

from __future__ import annotations

import errno
import importlib
import os
import stat
from collections.abc import Callable, Collection

from llmkv_fs.layout.names import block_place
from llmkv_fs.volume.beneath import OPENAT2, Beneath, LinkInTree

__all__ = ["COMPILED_PRESENCE", "BlockPresence", "compiled_check", "presence_path"]

# What a one-call open of a block's path answers when no block is there.
_NOT_A_BLOCK = frozenset((errno.ENOENT, errno.ELOOP, errno.ENOTDIR))
# The compiled check's answers per path (_presence.c).
_BLOCK, _UNSETTLED = 1, 2
COMPILED_PRESENCE = "compiled (_presence: openat2 and fstat in C, the GIL released per chunk)"
CompiledCheck = Callable[[int, bytes, list[bytes], tuple[int, ...], bool, int], bytes]


def _built() -> CompiledCheck | None:
    try:  # optional: compiled by the package's install where it can be
        module = importlib.import_module("llmkv_fs.engine.block._presence")
    except ImportError:
        return None
    check: CompiledCheck = module.check_keys
    return check


_BUILT = _built()


def compiled_check(allowed: bool = True) -> CompiledCheck | None:
    """The compiled batch check this process would use, or None (not
    built, no ``openat2``, or not ``allowed``: compiled_io off)."""
    return _BUILT if OPENAT2 and allowed else None


def presence_path(allowed: bool = True) -> str:
    """Which presence check this process runs, for the start-up log
    (``allowed``: the compiled_io setting)."""
    if not OPENAT2:
        return "python (no openat2 here: the walk, one level at a time)"
    if _BUILT is None:
        return "python (the compiled _presence is not built: no C compiler at install)"
    if not allowed:
        return "python (compiled_io is off)"
    return COMPILED_PRESENCE


class BlockPresence:
    """See the module doc. ``sizes``: the file lengths a block may have."""

    def __init__(
        self,
        below: Beneath,
        sizes: Collection[int],
        revalidate_misses: bool,
        compiled: bool = True,
    ):
        self._below = below
        self._sizes = sizes
        self._size_list = tuple(sizes)
        self._revalidate_misses = revalidate_misses
        self._compiled = compiled_check(compiled)

    @property
    def compiled(self) -> bool:
        """``many`` runs the compiled loop (else it is ``at`` per block)."""
        return self._compiled is not None and self._below.one_call

    def many(self, prefix: str, keys: list[bytes], budget_s: float = 0.0) -> list[bool]:
        """``at`` for the block of each key below ``prefix`` (the rank
        directory), in order: in one compiled call without the GIL where it
        runs, each block it cannot settle (a mount point on the way, NFS
        revalidation, ...) then by ``at`` itself. With ``budget_s`` the
        compiled call stops once that is spent: the answers are then for
        the first keys only (one at least). Raises what ``at`` raises
        (RootLost, OSError) for such a block."""
        check = self._compiled
        if check is None or not self._below.one_call:
            return [self.at(*block_place(prefix, key)) for key in keys]
        codes = check(
            self._below.root_fd(),
            prefix.encode("utf-8", "surrogateescape"),
            keys,
            self._size_list,
            self._revalidate_misses,
            int(budget_s * 1e9),
        )
        return [
            code == _BLOCK if code != _UNSETTLED else self.at(*block_place(prefix, key))
            for code, key in zip(codes, keys)
        ]

    def at(self, rel_dir: str, name: str) -> bool:
        """A block file is ``name`` in ``rel_dir`` (below the root). One
        ``openat2`` and an ``fstat`` where the kernel has it, settling a
        miss at once; the walk for anything that call cannot settle."""
        if self._below.one_call:
            try:
                fd = self._below.open_file(f"{rel_dir}/{name}", os.O_PATH)
            except OSError as exc:
                if exc.errno in _NOT_A_BLOCK and not (
                    exc.errno == errno.ENOENT and self._revalidate_misses
                ):
                    return False
            else:
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                return stat.S_ISREG(st.st_mode) and st.st_size in self._sizes
        try:
            return self._in(rel_dir, name)
        except FileNotFoundError:
            if not self._revalidate_misses:
                return False
        except LinkInTree:
            return False
        self._revalidate_dirs(rel_dir)
        try:
            return self._in(rel_dir, name)
        except (FileNotFoundError, LinkInTree):
            return False

    def _in(self, rel_dir: str, name: str) -> bool:
        dir_fd = self._below.open_dir(rel_dir)
        try:
            return self.block_at(dir_fd, name)
        finally:
            os.close(dir_fd)

    def block_at(self, dir_fd: int, name: str) -> bool:
        """``name`` in the directory open as ``dir_fd`` is a block file
        (lstat: a symlink at the name is not; nor is a file mounted there)."""
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return (
            stat.S_ISREG(st.st_mode)
            and st.st_size in self._sizes
            and st.st_dev == self._below.root_dev()
        )

    def _revalidate_dirs(self, rel_dir: str) -> None:
        """Really open the deepest existing directory between the block's
        directory and the rank directory (measured on NFS v4.2/v3 in an
        emulated guest: one open ~4.5 ms beside a 1.5 ms lstat; a block
        created on another client seen by the next check instead of ~30 s
        later). Only the last level is opened for reading: that open is
        what refetches its attributes."""
        parts = rel_dir.split("/")
        for depth in range(len(parts), 0, -1):
            try:
                os.close(self._below.open_dir("/".join(parts[:depth]), revalidate=True))
                return
            except OSError:
                continue
