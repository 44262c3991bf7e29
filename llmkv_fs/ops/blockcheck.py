"""Checking one block file from the outside, for ``llmkv-fs verify`` (and the
chunk-size probe ``llmkv-fs stats`` shares). Layout room only: no vLLM, no
engine; safe against a volume that live tiers are writing.

The chunk size (payload bytes per block) is not in ``config.json``: vLLM
takes it from the CPU tier's row stride, i.e. the model's KV bytes per
chunk. So it is inferred per digest from the files themselves: the payload
length a valid trailer records (a trailer carries its own checksum, so one
good trailer is proof), else -- a digest written only by vLLM's built-in
tier, which writes no trailers -- the most common file size.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import mmap
import os
import re
import stat
import threading
from collections.abc import Iterable

from llmkv_fs.layout.blockfile import TRAILER_SIZE, BlockFileError, unpack_trailer, verify_block
from llmkv_fs.layout.paths import BLOCK_SUFFIX, CacheLayout, split_key

__all__ = [
    "BAD", "ERROR", "UNVERIFIED", "VANISHED", "VERIFIED",
    "ChunkSize", "Result", "check_block", "infer_chunk_size", "is_block_name",
    "key_from_path", "open_for_check",
]

VERIFIED, UNVERIFIED, BAD, ERROR, VANISHED = "verified", "unverified", "bad", "error", "vanished"

_PAGE = mmap.PAGESIZE
O_NOATIME = getattr(os, "O_NOATIME", 0)
_BASE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
# "<hhh>/<hh>_g<group>/<hash>.bin" below a rank directory; the group is a
# decimal u32 without leading zeros (as block_path writes it).
_REL_RE = re.compile(r"^([0-9a-f]{3})/([0-9a-f]{2})_g(0|[1-9][0-9]{0,9})/([0-9a-f]+)\.bin$")
_PROBE_SIZES = 8       # distinct file sizes tried when looking for a trailer
_PROBE_PER_SIZE = 3    # files of one size tried


def is_block_name(name: str) -> bool:
    """A name a block file has (``<hash>.bin``, not hidden): what verify
    reads. Independent of scan's classification on purpose: a symlink or
    FIFO named like a block must be reported, whatever kind scan gives it."""
    return name.endswith(BLOCK_SUFFIX) and not name.startswith(".")


def key_from_path(rank_dir: str, path: str) -> bytes | None:
    """The OffloadKey whose ``block_path`` is ``path``, or None if ``path``
    is not a block path of ``rank_dir`` (a stray or misplaced file)."""
    prefix = rank_dir.rstrip("/") + "/"
    if not path.startswith(prefix):
        return None
    match = _REL_RE.match(path[len(prefix):])
    if match is None:
        return None
    top, mid, group, block_hash = match.groups()
    if len(block_hash) % 2 or int(group) >= 1 << 32:
        return None
    key = bytes.fromhex(block_hash) + int(group).to_bytes(4, "big")
    # Round trip through the one definition of the layout, so verify can
    # never disagree with the tier about which key a path holds.
    layout = CacheLayout(rank_dir, {}, 0)
    layout.__dict__["rank_dir"] = rank_dir.rstrip("/")  # cached_property slot
    if layout.block_path(key) != path or split_key(key)[0].hex() != block_hash:
        return None  # e.g. a hash too short for the <hhh>/<hh> fan-out
    return key


def open_for_check(path: str) -> tuple[int, bool]:
    """Open a block for reading without following a symlink, without
    blocking on a FIFO and -- where we may (our own files, or root) --
    without touching its atime: reading a block must not make it look
    recently used to LRU eviction (relatime bumps an atime <= mtime, which
    every never-loaded block has). Returns (fd, atime_preserved)."""
    if O_NOATIME:
        try:
            return os.open(path, _BASE_FLAGS | O_NOATIME), True
        except PermissionError:
            pass  # EPERM: not the owner and no CAP_FOWNER
    return os.open(path, _BASE_FLAGS), False


@dataclasses.dataclass(frozen=True)
class ChunkSize:
    payload: int | None  # None: the digest has no regular block files
    source: str          # "trailer", "trailer-less files" or "no block files"


def _trailer_payload(path: str, size: int) -> int | None:
    """The payload length a file's trailer records, if the file ends in a
    valid trailer that matches its size."""
    if size <= TRAILER_SIZE:
        return None
    try:
        fd, _ = open_for_check(path)
    except OSError:
        return None
    try:
        page = os.pread(fd, TRAILER_SIZE, size - TRAILER_SIZE)
        trailer = unpack_trailer(page)
    except (OSError, BlockFileError):
        return None
    finally:
        os.close(fd)
    return trailer.payload_len if trailer.payload_len == size - TRAILER_SIZE else None


def infer_chunk_size(files: Iterable[tuple[str, int]]) -> ChunkSize:
    """Chunk size of one digest from its regular block files' (path, size):
    reads at most a few trailer pages, most common sizes first."""
    by_size: dict[int, list[str]] = collections.defaultdict(list)
    for path, size in files:
        if size > 0:
            by_size[size].append(path)
    if not by_size:
        return ChunkSize(None, "no block files")
    ranked = sorted(by_size, key=lambda s: (-len(by_size[s]), s))
    for size in ranked[:_PROBE_SIZES]:
        for path in by_size[size][:_PROBE_PER_SIZE]:
            payload = _trailer_payload(path, size)
            if payload is not None:
                return ChunkSize(payload, "trailer")
    return ChunkSize(ranked[0], "trailer-less files")


@dataclasses.dataclass
class Result:
    path: str
    status: str                # VERIFIED, UNVERIFIED, BAD, ERROR or VANISHED
    nbytes: int = 0            # bytes read
    reason: str = ""           # BAD: engine's reason tokens + symlink/not-regular/bad-name
    detail: str = ""
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of what was judged
    atime_preserved: bool = True


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.by_size: dict[int, tuple[memoryview, memoryview]] = {}

    def get(self, chunk: int) -> tuple[memoryview, memoryview]:
        bufs = self.by_size.get(chunk)
        if bufs is None:
            # Payload plus two pages: the second tells a too-long file from a
            # good one in the same read, as the engine does.
            whole = memoryview(mmap.mmap(-1, chunk + 2 * _PAGE))
            bufs = (whole[:chunk], whole[chunk:])
            self.by_size[chunk] = bufs
        return bufs


_BUFFERS = _Buffers()


def _read_all(fd: int, buffers: list[memoryview]) -> int:
    """Fill ``buffers`` from offset 0 until EOF or full; the byte count."""
    done = 0
    total = sum(b.nbytes for b in buffers)
    while done < total:
        pending, skip = [], done
        for b in buffers:
            if skip >= b.nbytes:
                skip -= b.nbytes
                continue
            pending.append(b[skip:])
            skip = 0
        n = os.preadv(fd, pending, done)
        if n == 0:
            break
        done += n
    return done


def _bad(path: str, reason: str, detail: str, st: os.stat_result) -> Result:
    return Result(path, BAD, 0, reason, detail, (st.st_dev, st.st_ino))


def _size_reason(n: int, chunk: int) -> tuple[str, str]:
    reason = "truncated" if n < chunk else "bad-length"
    empty = " (empty)" if n == 0 else ""
    return reason, f"{n} bytes{empty}, expected {chunk + TRAILER_SIZE} (or {chunk} without trailer)"


def check_block(rank_dir: str, path: str, lst: os.stat_result, chunk: int) -> Result:
    """Judge one block file: ``lst`` is its lstat from the walk, ``chunk``
    its digest's payload size. Never follows a symlink, never opens a
    non-regular file, reads at most ``chunk`` + 2 pages."""
    if stat.S_ISLNK(lst.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return _bad(path, "symlink", f"symlink to {target!r}, not followed", lst)
    if not stat.S_ISREG(lst.st_mode):
        return _bad(path, "not-regular", f"file type {stat.filemode(lst.st_mode)[0]!r}", lst)
    key = key_from_path(rank_dir, path)
    if key is None:
        return _bad(path, "bad-name", "not a block path of this rank directory", lst)
    try:
        fd, preserved = open_for_check(path)
    except FileNotFoundError:
        return Result(path, VANISHED)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a symlink since the walk
            try:
                return _bad(path, "symlink", "symlink, not followed", os.lstat(path))
            except OSError:
                return Result(path, VANISHED)
        return Result(path, ERROR, 0, "open-error", str(exc))
    try:
        st = os.fstat(fd)
        result = Result(path, BAD, 0, "", "", (st.st_dev, st.st_ino), preserved)
        if not stat.S_ISREG(st.st_mode):
            result.reason, result.detail = "not-regular", "not a regular file"
            return result
        if st.st_size == 0:  # bad whatever the chunk size
            result.reason, result.detail = _size_reason(0, max(chunk, 0))
            return result
        if chunk <= 0:  # appeared after the listing found no sized block file
            return Result(path, ERROR, 0, "unknown-size", "no chunk size known for this digest")
        if st.st_size not in (chunk, chunk + TRAILER_SIZE):
            result.reason, result.detail = _size_reason(st.st_size, chunk)
            return result
        payload, scratch = _BUFFERS.get(chunk)
        n = result.nbytes = _read_all(fd, [payload, scratch])
        if n == chunk + TRAILER_SIZE:
            try:
                verify_block(payload, scratch[:TRAILER_SIZE], key, verify_checksum=True)
            except BlockFileError as exc:
                result.reason, result.detail = exc.reason, str(exc)
                return result
            result.status = VERIFIED
        elif n == chunk:
            result.status = UNVERIFIED  # vLLM's built-in tier wrote it
        else:
            result.reason, result.detail = _size_reason(n, chunk)
        return result
    except OSError as exc:
        return Result(path, ERROR, 0, "read-error", str(exc))
    finally:
        os.close(fd)
