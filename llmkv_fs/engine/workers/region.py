"""Handing the primary region to I/O worker processes: file descriptors of
the very pages the engine-core process maps, so a worker's load lands in the
CPU tier vLLM reads and a worker's store reads what vLLM wrote.

Why file descriptors found through /proc, not paths or the region object:
vLLM's ``SharedOffloadRegion`` unlinks its ``/dev/shm/vllm_offload_*.mmap``
names once every rank has mapped them, may map several segment files back
to back (MAP_FIXED) and closes every segment's fd but the first; the tier
itself receives only a memoryview. ``/proc/self/maps`` names every mapping
under that view with its device and inode, whatever became of the names, so
one generic path serves vLLM, benchmarks and tests. For each mapping the fd
is found, cheapest and least privileged first:

1. an fd this process holds on the same inode (``/proc/self/fd``; vLLM keeps
   the first segment's open) -- reopened read-write through its magic link,
   which works for unlinked files too;
2. the mapping's path, if it still exists and is the same inode;
3. ``/proc/self/map_files/<range>``, which opens any shared mapping but
   needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE (root in most containers
   with the default capability set does *not* have it).

A view no step can cover (private or anonymous memory, such as a bytearray,
or a later segment without privilege) raises ``NoHandover``; the engine then
runs its threads in-process and says why once. Workers receive the fds at
spawn (``pass_fds``) and rebuild the same layout with ``map_region``.

Threading: ``find_handover`` runs once at start-up on the caller's thread;
``map_region`` runs in a worker process.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["NoHandover", "RegionHandover", "Segment", "find_handover", "map_region"]

_PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10
_PROT_NONE = 0


class NoHandover(Exception):
    """The primary view cannot be mapped by another process (the message
    says why)."""


@dataclasses.dataclass(frozen=True)
class Segment:
    offset: int  # into the primary view
    length: int
    file_offset: int
    fd_index: int  # into RegionHandover.fds


@dataclasses.dataclass
class RegionHandover:
    size: int
    segments: tuple[Segment, ...]
    fds: list[int]  # owned: open read-write, close() releases them
    how: str  # which of the ways above found them, for the log

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


@dataclasses.dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    shared: bool
    file_offset: int
    dev: int
    inode: int
    path: str


def _read_maps() -> list[_Mapping]:
    mappings = []
    with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            mappings.append(
                _Mapping(
                    start,
                    end,
                    fields[1][3] == "s",
                    int(fields[2], 16),
                    os.makedev(major, minor),
                    int(fields[4]),
                    fields[5].rstrip("\n") if len(fields) > 5 else "",
                )
            )
    return mappings


def _held_fds() -> dict[tuple[int, int], int]:
    held: dict[tuple[int, int], int] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            st = os.fstat(int(name))
            held.setdefault((st.st_dev, st.st_ino), int(name))
    return held


def _same_inode(fd: int, mapping: _Mapping) -> bool:
    """``fd`` is the mapping's file; else (an fstat failing too) closed."""
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mapping.dev, mapping.inode):
            return True
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return False


def _open_mapping(mapping: _Mapping, held: dict[tuple[int, int], int]) -> tuple[int, str]:
    flags = os.O_RDWR | os.O_CLOEXEC
    fd_number = held.get((mapping.dev, mapping.inode))
    if fd_number is not None:
        with contextlib.suppress(OSError):
            fd = os.open(f"/proc/self/fd/{fd_number}", flags)
            if _same_inode(fd, mapping):
                return fd, "fd"
    if mapping.path.startswith("/") and not mapping.path.endswith(" (deleted)"):
        with contextlib.suppress(OSError):
            fd = os.open(mapping.path, flags | os.O_NOFOLLOW)
            if _same_inode(fd, mapping):
                return fd, "path"
    try:
        fd = os.open(f"/proc/self/map_files/{mapping.start:x}-{mapping.end:x}", flags)
    except OSError as exc:
        raise NoHandover(
            f"no fd for the mapping {mapping.start:#x}-{mapping.end:#x} ({mapping.path or 'anon'}):"
            f" no open fd or path to it, and /proc/self/map_files refused ({exc.strerror};"
            " it needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE)"
        ) from None
    return fd, "map_files"


def view_address(view: memoryview) -> int:
    if view.readonly:
        raise NoHandover("the primary view is read-only")
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def find_handover(view: memoryview) -> RegionHandover:
    """File descriptors and layout that let another process map exactly the
    pages under ``view``. Raises NoHandover."""
    address = view_address(view)
    size = view.nbytes
    if address % _PAGE:
        raise NoHandover("the primary view does not start on a page boundary")
    end = address + size
    covering = sorted(
        (m for m in _read_maps() if m.start < end and m.end > address), key=lambda m: m.start
    )
    expected = address
    for m in covering:
        if m.start > expected:
            break
        if not m.shared or m.inode == 0:
            raise NoHandover(
                "the primary buffer is private or anonymous memory (a bytearray or "
                "MAP_PRIVATE mmap); worker processes need a shared file mapping "
                "(vLLM's /dev/shm region, a memfd or a shared mmap)"
            )
        expected = m.end
    if not covering or covering[0].start > address or expected < end:
        raise NoHandover("the primary view is not covered by mappings in /proc/self/maps")
    held = _held_fds()
    fds: list[int] = []
    by_inode: dict[tuple[int, int], int] = {}
    segments = []
    ways = set()
    try:
        for m in covering:
            index = by_inode.get((m.dev, m.inode))
            if index is None:
                fd, how = _open_mapping(m, held)
                ways.add(how)
                index = by_inode[m.dev, m.inode] = len(fds)
                fds.append(fd)
            lo, hi = max(m.start, address), min(m.end, end)
            segments.append(Segment(lo - address, hi - lo, m.file_offset + lo - m.start, index))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return RegionHandover(size, tuple(segments), fds, "+".join(sorted(ways)))


def _libc_mmap() -> Any:
    fn = ctypes.CDLL(None, use_errno=True).mmap
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.argtypes.append(ctypes.c_long)
    fn.restype = ctypes.c_void_p
    return fn


def map_region(size: int, segments: Sequence[Segment], fds: Sequence[int]) -> memoryview:
    """Worker side: map ``segments`` back to back into one reserved range,
    as the owner has them (``fds``: the worker's numbers of the handover's
    fds). The mapping lives as long as the process."""
    libc_mmap = _libc_mmap()
    total = -(-size // _PAGE) * _PAGE
    failed = ctypes.c_void_p(-1).value
    base = libc_mmap(None, total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, failed):
        raise OSError(ctypes.get_errno(), "reserving the primary region's address range")
    for segment in segments:
        mapped_len = -(-segment.length // _PAGE) * _PAGE
        got = libc_mmap(
            base + segment.offset,
            mapped_len,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_SHARED | _MAP_FIXED,
            fds[segment.fd_index],
            segment.file_offset,
        )
        if got != base + segment.offset:
            raise OSError(ctypes.get_errno(), f"mapping segment at {segment.offset:#x}")
    return memoryview((ctypes.c_char * size).from_address(base)).cast("B")
