"""Checking one block file from the outside, for ``llmkv-fs verify`` (and
the chunk-size probe and the sealed-trailer count ``llmkv-fs stats``
shares). Reads through ``volume`` and ``layout`` (and reports through
``ops/scan.py``'s and ``ops/problems.py``'s words): no vLLM, no engine;
safe against a volume that live tiers are writing.

A block is judged by the rule the engine's loads apply
(layout/judgement.py), as a reader with checksums that accepts unverified
blocks in a plain namespace (it reads what either tier wrote). Whether the
namespace is sealed is its ``config.json``'s word, taken only when that
file hashes to the digest's name (``namespace_sealing``): it is then the
run config every tier of the namespace has. Without that proof each block
is judged by the format its own trailer claims -- which a forger writes --
and verify says so.

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
import stat
import threading
from collections.abc import Iterable, Mapping

from llmkv_fs.layout.blockfile import (
    TRAILER_SIZE,
    BlockFileError,
    file_sizes,
    length_fault,
    unpack_trailer,
)
from llmkv_fs.layout.judgement import BlockRules, Judgement
from llmkv_fs.layout.names import parse_block_path
from llmkv_fs.layout.sealed import NAMESPACE_FIELD, Keyring
from llmkv_fs.ops import scan
from llmkv_fs.ops.problems import kind_of
from llmkv_fs.volume.beneath import open_path_beneath
from llmkv_fs.volume.files import read_all
from llmkv_fs.volume.quarantine import file_ident
from llmkv_fs.volume.run_config import run_config_proves

__all__ = [
    "BAD",
    "ERROR",
    "FOREIGN",
    "SEALED",
    "UNVERIFIED",
    "VANISHED",
    "VERIFIED",
    "ChunkSize",
    "Result",
    "check_block",
    "chunk_size_of",
    "infer_chunk_size",
    "namespace_sealing",
    "open_for_check",
    "reader_rules",
    "sealed_trailer",
    "sealed_with",
    "undo_atime",
]

VERIFIED, UNVERIFIED, BAD, ERROR, VANISHED = "verified", "unverified", "bad", "error", "vanished"
# Sealed blocks (layout/sealed.py): SEALED could not be authenticated, no
# key given (its length and key were checked); FOREIGN is sealed with a key
# not given (another deployment's, or a retired one). Neither is bad.
SEALED, FOREIGN = "sealed", "foreign-key"
# What is not bad, by the shared judgement. NO_CHECKSUM never comes: verify
# accepts unverified blocks where a namespace may hold them.
_STATUS = {
    Judgement.VERIFIED: VERIFIED,
    Judgement.UNVERIFIED: UNVERIFIED,
    Judgement.SEALED_UNCHECKED: SEALED,
    Judgement.FOREIGN_KEY: FOREIGN,
}

_PAGE = mmap.PAGESIZE
O_NOATIME = getattr(os, "O_NOATIME", 0)
_BASE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
PROBE_SIZES = 8  # distinct file sizes tried when looking for a trailer
PROBE_PER_SIZE = 3  # files of one size tried


def open_for_check(path: str, dir_fd: int | None = None) -> tuple[int, bool]:
    """Open a block for reading without following a symlink, without
    blocking on a FIFO and -- where we may (our own files, or root) --
    without touching its atime: reading a block must not make it look
    recently used to LRU eviction (relatime bumps an atime <= mtime, which
    every never-loaded block has). ``path`` is relative to ``dir_fd`` if
    given. Returns (fd, atime_preserved)."""
    if O_NOATIME:
        try:
            return os.open(path, _BASE_FLAGS | O_NOATIME, dir_fd=dir_fd), True
        except PermissionError:
            pass  # EPERM: not the owner and no CAP_FOWNER
    return os.open(path, _BASE_FLAGS, dir_fd=dir_fd), False


def _open_block(rank_dir: str, path: str) -> tuple[int, bool]:
    """``open_for_check`` of a block below ``rank_dir``, its directories
    opened name by name: a directory swapped for a symlink since the walk
    is ELOOP or ENOTDIR, never a way off the volume."""
    dir_fd = open_path_beneath(rank_dir, os.path.dirname(path))
    try:
        return open_for_check(os.path.basename(path), dir_fd)
    finally:
        os.close(dir_fd)


def undo_atime(fd: int, before: os.stat_result) -> bool:
    """Put back the atime a read moved although the file was opened with
    O_NOATIME: an NFS client accepts the flag but the server stamps every
    READ (v4.2 and v3; docs/reliability.md), so stats or verify made 8-day-old blocks
    look used seconds ago. Returns whether the atime is as before. (A tier's
    load stamping the same block in between loses that stamp: the block
    looks as old as it was before the check, never younger.)"""
    try:
        after = os.fstat(fd)
        if after.st_atime_ns == before.st_atime_ns:
            return True
        if after.st_mtime_ns != before.st_mtime_ns:
            return False  # rewritten meanwhile: its new times are its own
        os.utime(fd, ns=(before.st_atime_ns, after.st_mtime_ns))
        return True
    except OSError:
        return False


def namespace_sealing(d: scan.Digest) -> tuple[bool | None, str]:
    """Whether ``d``'s blocks are sealed, as its config.json says when that
    file hashes to the digest's name (the run config every tier of the
    namespace has: its sealing field is part of the digest). (None, why)
    when it does not prove that: missing, unreadable, or altered."""
    config, why = d.config_status()
    if config is None:
        return None, why
    if not run_config_proves(config, d.digest):
        return None, f"config.json does not hash to {d.digest}"
    return config.get(NAMESPACE_FIELD) is not None, ""


def reader_rules(rank_dir: str, chunk: int, sealed: bool, keyring: Keyring | None) -> BlockRules:
    """The rules verify reads a rank directory's blocks by: checksums
    checked, unverified blocks accepted where the namespace may hold them
    (plain), sealed ones opened with ``keyring`` (None: unchecked)."""
    return BlockRules(
        chunk,
        sealed,
        checksum=True,
        accept_trailerless=not sealed,
        keyring=keyring if sealed else None,
        place=os.path.basename(rank_dir).encode("utf-8", "surrogateescape"),
    )


def sealed_trailer(rank_dir: str, path: str, size: int, chunk: int) -> str:
    """What the block file at ``path`` (``size`` bytes when listed) of a
    sealed namespace is by its own trailer, no key used: SEALED (its length
    and sealed trailer are right: ``BlockRules.judge_unopened``), the
    Corruption token that makes it bad there (a plain trailer:
    ``bad-version``), VANISHED or ERROR. Reads one trailer page, atime kept."""
    return sealed_with(rank_dir, path, size, chunk)[0]


def sealed_with(rank_dir: str, path: str, size: int, chunk: int) -> tuple[str, str | None]:
    """``sealed_trailer`` and, for a SEALED block, the key it was sealed
    with as a lease announces keys: ``"<key id>:<key check hex>"``."""
    key = parse_block_path(rank_dir, path)
    if key is None:
        return "bad-name", None
    rules = BlockRules(chunk, sealed=True)
    page = b""
    if size == chunk + TRAILER_SIZE:
        try:
            fd, _ = _open_block(rank_dir, path)
        except FileNotFoundError:
            return VANISHED, None
        except OSError:
            return ERROR, None
        try:
            before = os.fstat(fd)
            size = before.st_size
            page = os.pread(fd, TRAILER_SIZE, size - TRAILER_SIZE) if size > TRAILER_SIZE else b""
            undo_atime(fd, before)
        except OSError:
            return ERROR, None
        finally:
            os.close(fd)
    try:
        rules.judge_unopened(key, page, size)
    except BlockFileError as exc:
        return str(exc.reason), None
    seal = unpack_trailer(page).seal
    assert seal is not None  # judge_unopened refuses a plain trailer
    return SEALED, f"{seal.key_id}:{seal.key_check.hex()}"


@dataclasses.dataclass(frozen=True)
class ChunkSize:
    payload: int | None  # None: the digest has no regular block files
    source: str  # "trailer", "trailer-less files" or "no block files"


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
        before = os.fstat(fd)
        page = os.pread(fd, TRAILER_SIZE, size - TRAILER_SIZE)
        undo_atime(fd, before)
        trailer = unpack_trailer(page)
    except (OSError, BlockFileError):
        return None
    finally:
        os.close(fd)
    return trailer.payload_len if trailer.payload_len == size - TRAILER_SIZE else None


def infer_chunk_size(files: Iterable[tuple[str, int]]) -> ChunkSize:
    """Chunk size of one digest from its regular block files' (path, size):
    reads at most a few trailer pages, most common sizes first."""
    counts: collections.Counter[int] = collections.Counter()
    probes: dict[int, list[str]] = collections.defaultdict(list)
    for path, size in files:
        counts[size] += 1
        if len(probes[size]) < PROBE_PER_SIZE:
            probes[size].append(path)
    return chunk_size_of(counts, probes)


def chunk_size_of(counts: Mapping[int, int], probes: Mapping[int, list[str]]) -> ChunkSize:
    """``infer_chunk_size`` from how many files there are of each size and
    a few paths of each (``PROBE_PER_SIZE``): the first of the most common
    sizes (``PROBE_SIZES`` tried) whose files end in a trailer that agrees,
    else the most common size, trailer-less. Empty files never count."""
    ranked = sorted((s for s in counts if s > 0), key=lambda s: (-counts[s], s))
    if not ranked:
        return ChunkSize(None, "no block files")
    for size in ranked[:PROBE_SIZES]:
        for path in probes.get(size, [])[:PROBE_PER_SIZE]:
            payload = _trailer_payload(path, size)
            if payload is not None:
                return ChunkSize(payload, "trailer")
    return ChunkSize(ranked[0], "trailer-less files")


@dataclasses.dataclass
class Result:
    path: str
    status: str  # VERIFIED, UNVERIFIED, BAD, ERROR or VANISHED
    nbytes: int = 0  # bytes read
    reason: str = ""  # BAD: engine's reason tokens + symlink/not-regular/bad-name
    detail: str = ""
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of what was judged
    atime_preserved: bool = True
    error_kind: str = ""  # ERROR: the errno's name (EIO, EACCES, ...)


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


def _bad(path: str, reason: str, detail: str, st: os.stat_result) -> Result:
    return Result(path, BAD, 0, reason, detail, file_ident(st))


def _size_reason(n: int, chunk: int, trailerless: bool) -> tuple[str, str]:
    fault = length_fault(n, chunk, trailerless)
    return str(fault.reason), str(fault).split(": ", 1)[1]


def _claims_sealed(n: int, chunk: int, page: memoryview) -> bool:
    """Whether a block file of ``n`` bytes ends in an intact sealed trailer
    (``page``): what its namespace is taken to be when unproven."""
    if n != chunk + TRAILER_SIZE:
        return False
    try:
        return unpack_trailer(page).seal is not None
    except BlockFileError:
        return False


def check_block(
    rank_dir: str,
    path: str,
    lst: os.stat_result,
    chunk: int,
    keyring: Keyring | None = None,
    sealed: bool | None = False,
) -> Result:
    """Judge one block file (``lst``: its lstat from the walk; ``chunk``: its
    digest's payload size; ``sealed``: its namespace's sealing, None when
    unproven -- then each file by its own trailer's format; ``keyring``: to
    open sealed blocks, None: SEALED). Never follows a link or opens a
    non-regular file; reads <= chunk + 2 pages."""
    if stat.S_ISLNK(lst.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return _bad(path, "symlink", f"symlink to {target!r}, not followed", lst)
    if not stat.S_ISREG(lst.st_mode):
        return _bad(path, "not-regular", f"file type {stat.filemode(lst.st_mode)[0]!r}", lst)
    key = parse_block_path(rank_dir, path)
    if key is None:
        return _bad(path, "bad-name", "not a block path of this rank directory", lst)
    try:
        fd, preserved = _open_block(rank_dir, path)
    except FileNotFoundError:
        return Result(path, VANISHED)
    except OSError as exc:
        if exc.errno == errno.ELOOP and exc.filename == os.path.basename(path):
            try:  # the block itself replaced by a symlink since the walk
                return _bad(path, "symlink", "symlink, not followed", os.lstat(path))
            except OSError:
                return Result(path, VANISHED)
        return Result(path, ERROR, 0, "open-error", str(exc), error_kind=kind_of(exc))
    try:
        return _judge_open(fd, preserved, rank_dir, path, key, chunk, keyring, sealed)
    except OSError as exc:
        return Result(path, ERROR, 0, "read-error", str(exc), error_kind=kind_of(exc))
    finally:
        os.close(fd)


def _judge_open(
    fd: int,
    preserved: bool,
    rank_dir: str,
    path: str,
    key: bytes,
    chunk: int,
    keyring: Keyring | None,
    sealed: bool | None,
) -> Result:
    """``check_block`` of the block open as ``fd``; raises OSError."""
    # A trailer-less file may be a plain namespace's (vLLM's built-in wrote it).
    trailerless = sealed is not True
    st = os.fstat(fd)
    result = Result(path, BAD, 0, "", "", file_ident(st), preserved)
    if not stat.S_ISREG(st.st_mode):
        result.reason, result.detail = "not-regular", "not a regular file"
        return result
    if st.st_size == 0:  # bad whatever the chunk size
        result.reason, result.detail = _size_reason(0, max(chunk, 0), trailerless)
        return result
    if chunk <= 0:  # appeared after the listing found no sized block file
        return Result(path, ERROR, 0, "unknown-size", "no chunk size known for this digest")
    if st.st_size not in file_sizes(chunk, trailerless):
        result.reason, result.detail = _size_reason(st.st_size, chunk, trailerless)
        return result
    payload, scratch = _BUFFERS.get(chunk)
    n = result.nbytes = read_all(fd, [payload, scratch])
    result.atime_preserved = undo_atime(fd, st)
    page = scratch[:TRAILER_SIZE]
    if sealed is None:
        sealed = _claims_sealed(n, chunk, page)
    try:
        judged = reader_rules(rank_dir, chunk, sealed, keyring).judge(key, payload, page, n)
    except BlockFileError as exc:
        result.reason, result.detail = exc.reason, str(exc)
        return result
    result.status = _STATUS[judged]
    return result
