"""Where a block's time goes: µs per block by class, for issue 20 (ours vs
vLLM's built-in fs tier on memory-speed media). No perf or strace needed.

Part ``isolated`` (one process, one thread, a memfd primary region of
``--rows`` rows, so rows are cold in cache as in a long burst): each
component of what a worker does per block, timed alone --

* hashing: xxh3-64 of a row, whole and in 1 MiB pieces (cold), and hot;
* memory traffic: a memcpy of a row, pwritev of row + trailer into a new
  tmpfs file, preadv back into a row, unlink of a written file;
* page faults: the same preadv / pwritev through a *fresh* mapping of the
  region (as a worker process has: no page-table entries yet), with
  ``MADV_POPULATE_WRITE`` of the row first, and the faults counted;
* syscalls: the directory walk (``Beneath.open_dir``, 3 levels), the temp
  file's exclusive create, close, rename, access, stat, open for reading,
  utime, unlink, mkdir;
* whole paths: ``BlockIO.store`` / ``load`` (checksum on and off) and, with
  ``--builtin PAYLOAD``, vLLM's C ``batch_store_block`` / ``batch_load_block``
  over jobs of 8 -- what is left of ours after the parts above is Python;
* the worker's record traffic: job record out, decoded, result record
  back through two pipes (both ends in this process).

Part ``engine`` (tools/profile_engine.py): the real engine's worker path,
with per-process CPU, run-queue wait, off-CPU time, page faults and context
switches per block from /proc, cold and steady, and variants (region
populated at worker start, checksum off, threads).

    python3 tools/profile_block.py --dir /dev/shm/prof --builtin .bench_payload \
        --json prof.json
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import mmap
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable

if importlib.util.find_spec("llmkv_fs") is None:  # a checkout, not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import xxhash
from bench_support import IDENTITY, MiB, machine, make_keys

from llmkv_fs.engine.block.blockio import BlockIO, IoOptions, probe_o_direct
from llmkv_fs.engine.workers.records import JOB, OP_STORE, encode_result, job_record, take_results
from llmkv_fs.layout.beneath import Beneath
from llmkv_fs.layout.blockfile import TRAILER_SIZE
from llmkv_fs.layout.paths import CacheLayout

MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def per_call_us(fn: Callable[[int], object], n: int, repeats: int = 3) -> float:
    """Best of ``repeats`` passes of fn(0..n-1): µs per call."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


class Region:
    """``rows`` rows of ``block`` bytes in a memfd, mapped and filled."""

    def __init__(self, rows: int, block: int):
        self.rows, self.block = rows, block
        self.fd = os.memfd_create("profile_region", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, rows * block)
        self.mm = mmap.mmap(self.fd, rows * block)
        self.view = memoryview(self.mm)
        tail = os.urandom(block - 8)
        for i in range(rows):
            self.mm[i * block : (i + 1) * block] = i.to_bytes(8, "little") + tail

    def row(self, i: int, view: memoryview | None = None) -> memoryview:
        v = self.view if view is None else view
        i %= self.rows
        return v[i * self.block : (i + 1) * self.block]

    def fresh(self) -> tuple[mmap.mmap, memoryview]:
        """A new mapping of the same pages: no page-table entries yet."""
        mm = mmap.mmap(self.fd, self.rows * self.block)
        return mm, memoryview(mm)


def hashing(region: Region) -> dict[str, float]:
    n, piece = region.rows, MiB

    def pieces(i: int) -> int:
        h = xxhash.xxh3_64()
        row = region.row(i)
        for off in range(0, region.block, piece):
            h.update(row[off : off + piece])
        return h.intdigest()

    hot = region.row(0)
    return {
        "xxh3 row, cold": per_call_us(lambda i: xxhash.xxh3_64_intdigest(region.row(i)), n),
        "xxh3 row in 1 MiB pieces, cold": per_call_us(pieces, n),
        "xxh3 row, hot (in cache)": per_call_us(lambda i: xxhash.xxh3_64_intdigest(hot), 64),
    }


def memory(region: Region, where: str) -> dict[str, float]:
    n, block = region.rows, region.block
    dst = mmap.mmap(-1, block)
    dst_addr = address(memoryview(dst))
    trailer = memoryview(mmap.mmap(-1, 2 * mmap.PAGESIZE))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    paths = [os.path.join(where, f"m{i}") for i in range(n)]
    fds = [os.open(p, flags, 0o644) for p in paths]
    out = {
        "memcpy row (cold source)": per_call_us(
            lambda i: ctypes.memmove(dst_addr, address(region.row(i)), block), n
        ),
        "pwritev row+trailer, new tmpfs file": per_call_us(
            lambda i: os.pwritev(fds[i], [region.row(i), trailer[:TRAILER_SIZE]], 0), n, 1
        ),
        "pwritev row+trailer, overwrite": per_call_us(
            lambda i: os.pwritev(fds[i], [region.row(i), trailer[:TRAILER_SIZE]], 0), n
        ),
    }
    for fd in fds:
        os.close(fd)
    fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths]
    out["preadv row+trailer (mapped row)"] = per_call_us(
        lambda i: os.preadv(fds[i], [region.row(i), trailer], 0), n
    )
    out.update(faults(region, fds, trailer, where))
    for fd in fds:
        os.close(fd)
    out["unlink a written 2 MiB file"] = per_call_us(lambda i: os.unlink(paths[i]), n, 1)
    dst.close()
    return out


def faults(region: Region, fds: list[int], trailer: memoryview, where: str) -> dict[str, float]:
    """preadv / pwritev through a fresh mapping (a worker's first touch)."""
    n, out = region.rows, {}

    def counted(label: str, fn: Callable[[int, memoryview], object]) -> None:
        mm, view = region.fresh()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out[label] = per_call_us(lambda i: fn(i, view), n, 1)
        out[label + ": faults/block"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        ) / n
        view.release()
        mm.close()

    def populate_then_read(i: int, view: memoryview) -> None:
        row = region.row(i, view)
        if _libc.madvise(address(row), row.nbytes, MADV_POPULATE_WRITE):
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
        os.preadv(fds[i], [row, trailer], 0)

    def populate_only(i: int, view: memoryview) -> None:
        row = region.row(i, view)
        if _libc.madvise(address(row), row.nbytes, MADV_POPULATE_WRITE):
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")

    counted(
        "preadv into a fresh mapping (load, first touch)",
        lambda i, v: os.preadv(fds[i], [region.row(i, v), trailer], 0),
    )
    counted("MADV_POPULATE_WRITE row, then preadv", populate_then_read)
    counted("MADV_POPULATE_WRITE row alone", populate_only)
    counted("xxh3 of a row via a fresh mapping", lambda i, v: xxhash.xxh3_64(region.row(i, v)))
    wfds = [
        os.open(os.path.join(where, f"w{i}"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        for i in range(n)
    ]
    for i in range(n):  # allocate the file pages first: only the faults differ
        os.pwritev(wfds[i], [region.row(i)], 0)
    counted(
        "pwritev from a fresh mapping (store, first touch)",
        lambda i, v: os.pwritev(wfds[i], [region.row(i, v)], 0),
    )
    for i, fd in enumerate(wfds):
        os.close(fd)
        os.unlink(os.path.join(where, f"w{i}"))
    return out


def fd_paths(region: Region, where: str) -> dict[str, float]:
    """Moving a row through the region's file descriptor instead of a
    mapping (no page-table entries, so no first-touch faults): 1 MiB pieces
    through a private buffer that stays in cache, hashed there; and
    sendfile (in-kernel copy, no hash)."""
    n, block, piece = region.rows, region.block, MiB
    buf = memoryview(mmap.mmap(-1, piece))
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fds = [os.open(os.path.join(where, f"f{i}"), flags, 0o644) for i in range(n)]

    def store(i: int) -> int:
        h = xxhash.xxh3_64()
        for off in range(0, block, piece):
            os.preadv(region.fd, [buf], (i % n) * block + off)
            h.update(buf)
            os.pwritev(fds[i], [buf], off)
        return h.intdigest()

    def load(i: int) -> int:
        h = xxhash.xxh3_64()
        for off in range(0, block, piece):
            os.preadv(fds[i], [buf], off)
            h.update(buf)
            os.pwritev(region.fd, [buf], (i % n) * block + off)
        return h.intdigest()

    out = {"store via region fd: pread piece, xxh3, pwrite (new file)": per_call_us(store, n, 1)}
    out["load via region fd: pread piece, xxh3, pwrite to region"] = per_call_us(load, n)
    for i, fd in enumerate(fds):
        os.close(fd)
        os.unlink(os.path.join(where, f"f{i}"))
    fds = [os.open(os.path.join(where, f"s{i}"), flags, 0o644) for i in range(n)]
    out["sendfile region -> new file (no hash)"] = per_call_us(
        lambda i: os.sendfile(fds[i], region.fd, i * block, block), n, 1
    )
    for i, fd in enumerate(fds):
        os.close(fd)
        os.unlink(os.path.join(where, f"s{i}"))
    return out


def syscalls(where: str, n: int = 2000) -> dict[str, float]:
    below = Beneath(where)
    os.makedirs(os.path.join(where, "r/abc/de_g0"), exist_ok=True)
    dir_fd = below.open_dir("r/abc/de_g0")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    out = {
        "open_dir (3 levels, O_PATH) + close": per_call_us(
            lambda i: os.close(below.open_dir("r/abc/de_g0")), n
        ),
        "create temp (O_EXCL) + close": per_call_us(
            lambda i: os.close(os.open(f"t{i}", flags, 0o644, dir_fd=dir_fd)), n, 1
        ),
        "rename": per_call_us(
            lambda i: os.rename(f"t{i}", f"b{i}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd), n, 1
        ),
        "access (absent)": per_call_us(
            lambda i: os.access(f"x{i}", os.F_OK, dir_fd=dir_fd, follow_symlinks=False), n
        ),
        "stat": per_call_us(lambda i: os.stat(f"b{i}", dir_fd=dir_fd, follow_symlinks=False), n),
        "open O_RDONLY + close": per_call_us(
            lambda i: os.close(os.open(f"b{i}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)), n
        ),
        "utime": per_call_us(lambda i: os.utime(f"b{i}", dir_fd=dir_fd), n),
        "unlink (empty file)": per_call_us(lambda i: os.unlink(f"b{i}", dir_fd=dir_fd), n, 1),
        "mkdir": per_call_us(lambda i: os.mkdir(f"d{i}", 0o755, dir_fd=dir_fd), n, 1),
        "os.getpid (syscall floor)": per_call_us(lambda i: os.getppid(), n),
    }
    os.close(dir_fd)
    return out


def whole_paths(region: Region, where: str, payload: str | None) -> dict[str, float]:
    n, out = region.rows, {}
    for checksum in (True, False):
        root = os.path.join(where, f"blockio-{checksum}")
        os.makedirs(root)
        layout = CacheLayout.for_identity(root, IDENTITY)
        direct = probe_o_direct(root)  # as the engine decides it (tmpfs: yes on 6.6+)
        options = IoOptions(region.block, direct, False, False, checksum, hash_chunk=MiB)
        blockio = BlockIO(layout, options)
        keys = make_keys(n, f"p{checksum}")
        tag = ("checksum on" if checksum else "checksum off") + (", O_DIRECT" if direct else "")
        out[f"BlockIO.store, {tag}"] = per_call_us(
            lambda i, b=blockio, k=keys: b.store(k[i], region.row(i)), n, 1
        )
        out[f"BlockIO.load, {tag}"] = per_call_us(
            lambda i, b=blockio, k=keys: b.load(k[i], region.row(i)), n
        )
        shutil.rmtree(root)
    if payload:
        out.update(builtin_paths(region, where, payload))
    return out


def builtin_paths(region: Region, where: str, payload: str) -> dict[str, float]:
    from bench_builtin import BuiltinTier, load_payload

    loaded = load_payload(payload)
    io = loaded.io
    root = os.path.join(where, "builtin")
    tier = BuiltinTier(loaded, root, region.mm, region.block, 1)
    tier.shutdown()  # only its paths and O_DIRECT choice are used
    keys = make_keys(region.rows, "builtin")
    paths = [tier._path(k) for k in keys]
    jobs = region.rows // 8

    def batch(store: bool) -> Callable[[int], object]:
        def call(j: int) -> object:
            lo = j * 8
            offsets = [(lo + k) * region.block for k in range(8)]
            fn = io.batch_store_block if store else io.batch_load_block
            return fn(paths[lo : lo + 8], region.view, offsets, region.block, tier.use_o_direct)

        return call

    out = {
        "vLLM C batch_store_block (per block, jobs of 8)": per_call_us(batch(True), jobs, 1) / 8,
        "vLLM C batch_load_block (per block, jobs of 8)": per_call_us(batch(False), jobs) / 8,
    }
    shutil.rmtree(root + "_r0", ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return out


def records(n: int = 20000) -> dict[str, float]:
    """A block's job record and result record, through two pipes."""
    jobs_r, jobs_w = os.pipe()
    results_r, results_w = os.pipe()
    key, buf = make_keys(1, "rec")[0], bytearray()
    from llmkv_fs.engine.outcomes import Outcome

    def round_trip(i: int) -> None:
        os.write(jobs_w, job_record(OP_STORE, 3, i, key))
        data = os.read(jobs_r, 1 << 16)
        _op, slot, _chunk, key_len = JOB.unpack_from(data)
        bytes(data[JOB.size : JOB.size + key_len])
        os.write(results_w, encode_result(slot, Outcome.WRITTEN))
        buf.extend(os.read(results_r, 1 << 16))
        take_results(buf)

    out = {"job + result records through 2 pipes": per_call_us(round_trip, n)}
    for fd in (jobs_r, jobs_w, results_r, results_w):
        os.close(fd)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="medium (a scratch folder inside is removed)")
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--rows", type=int, default=256, help="rows of the isolated region")
    p.add_argument("--builtin", metavar="PAYLOAD_DIR")
    p.add_argument("--part", choices=("isolated", "engine", "both"), default="both")
    p.add_argument("--engine-blocks", type=int, default=2048)
    p.add_argument("--variants", default="workers,populate,nochecksum,threads")
    p.add_argument("--io-workers", default="auto", help="the workers variants' io_workers")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    where = os.path.join(args.dir, f"profile-{os.getpid()}")
    os.makedirs(where)
    block = int(args.block_mib * MiB)
    result: dict = {"machine": machine([args.dir]), "block": block}
    try:
        if args.part in ("isolated", "both"):
            result["isolated"] = isolated(args, where, block)
        if args.part in ("engine", "both"):
            from profile_engine import engine_profiles

            result["engine"] = engine_profiles(args, where, block)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    result["machine"]["load_average_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


def isolated(args, where: str, block: int) -> dict[str, dict[str, float]]:
    region = Region(args.rows, block)
    parts = {
        "hashing": hashing(region),
        "memory": memory(region, where),
        "fd path": fd_paths(region, where),
        "syscalls": syscalls(where),
        "paths": whole_paths(region, where, args.builtin),
        "records": records(),
    }
    print(f"\n## one process, one thread: µs per block ({block >> 10} KiB rows, cold)\n")
    print("| class | what | µs |\n|---|---|---|")
    for part, values in parts.items():
        for what, us in values.items():
            print(f"| {part} | {what} | {us:.2f} |")
    sys.stdout.flush()
    return parts


if __name__ == "__main__":
    sys.exit(main())
