"""How the engine moves bytes, decided once at start-up: the primary
buffer as rows, O_DIRECT or buffered I/O, and the per-block options
BlockIO gets. No threads; runs on the constructing thread.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
from collections.abc import Sequence

from llmkv_fs.config import TierSettings
from llmkv_fs.engine.block.bytes_c import compiled_available
from llmkv_fs.engine.block.options import IoOptions
from llmkv_fs.engine.startup.probe import probe_o_direct
from llmkv_fs.engine.upkeep.prepare import EngineError
from llmkv_fs.layout.blockfile import Buffer
from llmkv_fs.volume.pinned_root import PinnedRoot

__all__ = [
    "choose_o_direct",
    "for_worker_processes",
    "io_options",
    "io_thread_counts",
    "memory_backed",
    "primary_bytes",
]

# Memory-backed volumes, where a load is a memcpy: hash each piece while it
# is still in cache, a piece that stays in L2 while every place copies at
# once. I/O threads on the Python byte path take a larger one: there each
# piece is one more release and re-acquire of vLLM's GIL (the compiled path
# hashes a whole slice's pieces without it). The measurements that chose
# both: docs/bench/history.md and docs/benchmarks.md, "The hash piece".
_MEMORY_FS = frozenset(("tmpfs", "ramfs"))
_HASH_PIECE = 256 << 10
_HASH_PIECE_PYTHON_THREADS = 1 << 20
# Sealed blocks, on any volume: I/O threads encrypt a whole block (up to
# this) in one cipher call, since each call takes vLLM's GIL back once;
# worker processes share no GIL and keep a piece in L2 between the copy and
# the cipher (docs/benchmarks.md, "Sealed against unsealed", has the figures).
_SEAL_PIECE_THREADS = 4 << 20
_SEAL_PIECE_WORKERS = 256 << 10


def _hash_piece(settings: TierSettings) -> int:
    """The piece I/O threads hash a block in on memory-backed volumes."""
    compiled = settings.compiled_io and compiled_available()
    return _HASH_PIECE if compiled else _HASH_PIECE_PYTHON_THREADS


def memory_backed(fstype: str) -> bool:
    """The volume keeps its files in memory: a load or a store is a memcpy."""
    return fstype in _MEMORY_FS


def io_thread_counts(
    settings: TierSettings, fstypes: Sequence[str], cpus: int
) -> tuple[int, int, str]:
    """How many read- and write-priority I/O threads to run, and why where
    it is not the settings' count. On volumes that keep their files in
    memory (every root tmpfs or ramfs) there is no device latency for more
    threads to hide: a block is CPU work (the copy and the hash), so past one
    thread per CPU threads only take turns -- and on the Python byte path
    queue for the GIL (docs/benchmarks.md, "Small blocks"). There the total
    is capped at the CPU count (at least one of each kind); elsewhere the
    settings stand."""
    reads, writes = settings.n_read_threads, settings.n_write_threads
    if not fstypes or not all(memory_backed(f) for f in fstypes) or reads + writes <= cpus:
        return reads, writes, ""
    cap = max(2, cpus)
    capped_reads = max(1, min(reads, cap * reads // (reads + writes)))
    capped_writes = max(1, min(writes, cap - capped_reads))
    why = (
        f" (of {reads} + {writes}: the volume is memory-backed and the process "
        f"may use {cpus} CPU(s))"
    )
    return capped_reads, capped_writes, why


def io_options(
    settings: TierSettings,
    block_size: int,
    use_o_direct: bool,
    fstype: str,
    root: PinnedRoot,
) -> IoOptions:
    return IoOptions(
        block_size=block_size,
        use_o_direct=use_o_direct,
        fsync_file=settings.durability in ("file", "full"),
        fsync_dir=settings.durability == "full",
        checksum=settings.checksum,
        accept_trailerless=settings.accept_trailerless,
        file_mode=settings.file_mode,
        dir_mode=settings.dir_mode,
        hash_chunk=_hash_piece(settings) if fstype in _MEMORY_FS else 0,
        # A client's cached "no such file" hides a block another client
        # stored for up to acdirmax (measured ~30 s; docs/reliability.md).
        revalidate_misses=fstype.startswith("nfs"),
        root=root,
        sealed=settings.seal_key_files is not None,
        seal_piece=_SEAL_PIECE_THREADS,
        compiled=settings.compiled_io,
    )


def primary_bytes(primary: Buffer, block_size: int) -> memoryview:
    """The primary buffer as flat bytes, checked to hold whole blocks."""
    view = memoryview(primary).cast("B")
    if block_size <= 0 or view.nbytes % block_size:
        raise EngineError(
            f"primary buffer of {view.nbytes} bytes is not a whole "
            f"number of {block_size}-byte blocks"
        )
    return view


def _buffer_address(buf: memoryview) -> int | None:
    if buf.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def choose_o_direct(mode: str, primary: memoryview, block_size: int, rank_dir: str) -> bool:
    """Whether blocks move with O_DIRECT: io_mode ``auto`` uses it where the
    buffer and block size are page aligned and the volume takes it (probed
    in ``rank_dir``, resolved beneath its root: a rank directory swapped for a
    symlink is not written to); ``direct`` insists (EngineError naming why
    not)."""
    if mode == "buffered":
        return False
    address = _buffer_address(primary)
    aligned = (
        address is not None and address % mmap.PAGESIZE == 0 and block_size % mmap.PAGESIZE == 0
    )
    # The rank directory is a child of the root (CacheLayout).
    works = aligned and probe_o_direct(rank_dir, root=os.path.dirname(rank_dir))
    if mode == "direct" and not works:
        why = (
            "the volume refuses it"
            if aligned
            else "the primary buffer or block size is not page aligned"
        )
        raise EngineError(
            f"io_mode=direct but O_DIRECT does not work here ({why}): "
            f"{rank_dir}. Use io_mode=auto or buffered."
        )
    return works


def for_worker_processes(options: IoOptions) -> IoOptions:
    """The options an I/O worker process moves blocks with: those of the
    engine's threads, with the in-cache hash piece where pieces are used
    (threads on the Python path take a larger one) and the smaller sealing
    piece."""
    hash_chunk = _HASH_PIECE if options.hash_chunk else 0
    return dataclasses.replace(options, hash_chunk=hash_chunk, seal_piece=_SEAL_PIECE_WORKERS)
