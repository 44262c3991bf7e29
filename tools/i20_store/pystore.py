"""issue 20: store-only, N forked processes running our real BlockIO.store
(variants) against vLLM's fs_io_C batch_store_block in N threads (as its
pool runs it) and in N processes. Per worker CPU user/sys from getrusage.
Untracked helper (tools/i20)."""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import shutil
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
if os.environ.get("I20_PKG"):
    sys.path.insert(0, os.environ["I20_PKG"])
else:
    sys.path.insert(0, os.path.join(HERE, "..", ".."))

from bench_support import IDENTITY, make_keys  # noqa: E402

from llmkv_fs.engine.block.blockio import BlockIO, IoOptions, probe_o_direct  # noqa: E402
from llmkv_fs.layout.paths import CacheLayout  # noqa: E402

MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class Region:
    def __init__(self, rows: int, block: int):
        self.rows, self.block = rows, block
        self.fd = os.memfd_create("region", 0)
        os.ftruncate(self.fd, rows * block)
        self.mm = mmap.mmap(self.fd, rows * block)
        self.view = memoryview(self.mm)
        tail = os.urandom(block - 8)
        for i in range(rows):
            self.mm[i * block : (i + 1) * block] = i.to_bytes(8, "little") + tail

    def populate(self) -> None:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        _libc.madvise(addr, self.rows * self.block, 23)

    def row(self, i: int) -> memoryview:
        i %= self.rows
        return self.view[i * self.block : (i + 1) * self.block]


def ru(thread: bool) -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_THREAD if thread else resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def make_worker(variant: str, region: Region, root: str, payload, block: int):
    """A callable(w, n_workers, keys) storing its share of keys."""
    if variant.startswith("builtin"):
        from bench_builtin import BuiltinTier

        tier = BuiltinTier(payload, root, region.mm, block, 1)
        tier._pool.shutdown(wait=True)
        io, direct = payload.io, tier.use_o_direct

        def run(w: int, n: int, keys: list[bytes]) -> int:
            mine = list(range(w, len(keys), n))
            for j in range(0, len(mine), 8):
                idx = mine[j : j + 8]
                io.batch_store_block(
                    [tier._path(keys[i]) for i in idx],
                    region.view,
                    [(i % region.rows) * block for i in idx],
                    block,
                    direct,
                )
            return len(mine)

        return run
    layout = CacheLayout.for_identity(root, IDENTITY)
    os.makedirs(layout.rank_dir, exist_ok=True)
    direct = probe_o_direct(root)
    checksum = variant != "ours_nock"
    from llmkv_fs.engine.block import blockio as _bio
    from llmkv_fs.engine.block import piecewise as _pw

    order = {"b": "before", "a": "after", "L": "afterL"}.get(variant[0])
    if order:
        _bio.write_hashing = _pw._ORDERS[order]
        size = variant[1:]
        chunk = {"256": 256 << 10, "512": 512 << 10, "1m": MiB, "128": 128 << 10}[size]
    else:
        chunk = {"ours256": 256 << 10, "ours1m": MiB, "ours0": 0, "ours_nock": 0}[variant]
    options = IoOptions(block, direct, False, False, checksum, hash_chunk=chunk)
    bio = BlockIO(layout, options)

    def run(w: int, n: int, keys: list[bytes]) -> int:
        c = 0
        for i in range(w, len(keys), n):
            bio.store(keys[i], region.row(i))
            c += 1
        return c

    return run


def one(variant: str, mode: str, n: int, region: Region, where: str, payload, total: int, tag: str):
    root = os.path.join(where, f"r-{variant}-{mode}-{n}-{tag}")
    os.makedirs(root, exist_ok=True)
    keys = make_keys(total, f"{variant}-{mode}-{n}-{tag}")
    run = make_worker(variant, region, root, payload, region.block)
    rd, wr = os.pipe()
    go_r, go_w = os.pipe()
    t0 = 0.0
    if mode == "p":
        pids = []
        for w in range(n):
            pid = os.fork()
            if pid == 0:
                try:
                    os.umask(0)
                    region.populate()
                    os.write(wr, b"r")
                    os.read(go_r, 1)
                    u0, s0, f0 = ru(False)
                    t = time.perf_counter()
                    c = run(w, n, keys)
                    wall = time.perf_counter() - t
                    u1, s1, f1 = ru(False)
                    os.write(wr, (json.dumps([wall, u1 - u0, s1 - s0, c, f1 - f0]) + "\n").encode())
                finally:
                    os._exit(0)
            pids.append(pid)
        got = 0
        while got < n:
            got += len(os.read(rd, n - got))
        t0 = time.perf_counter()
        os.write(go_w, b"g" * n)
        outs = []
        buf = b""
        while len(outs) < n:
            buf += os.read(rd, 65536)
            *lines, buf = buf.split(b"\n")
            outs += [json.loads(x) for x in lines if x]
        wall = time.perf_counter() - t0
        for pid in pids:
            os.waitpid(pid, 0)
    else:
        outs = []
        barrier = threading.Barrier(n + 1)
        lock = threading.Lock()

        def th(w: int) -> None:
            barrier.wait()
            u0, s0, f0 = ru(True)
            t = time.perf_counter()
            c = run(w, n, keys)
            wt = time.perf_counter() - t
            u1, s1, f1 = ru(True)
            with lock:
                outs.append([wt, u1 - u0, s1 - s0, c, f1 - f0])

        ts = [threading.Thread(target=th, args=(w,)) for w in range(n)]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        wall = time.perf_counter() - t0
    for fd in (rd, wr, go_r, go_w):
        os.close(fd)
    blocks = sum(o[3] for o in outs)
    row = {
        "variant": variant,
        "mode": mode,
        "n": n,
        "gbps": round(blocks * region.block / wall / 1e9, 2),
        "wall_us": round(sum(o[0] for o in outs) / blocks * 1e6),
        "user_us": round(sum(o[1] for o in outs) / blocks * 1e6),
        "sys_us": round(sum(o[2] for o in outs) / blocks * 1e6),
        "minflt": round(sum(o[4] for o in outs) / blocks, 1),
    }
    row["cpu_us"] = row["user_us"] + row["sys_us"]
    t = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(root + "_r0", ignore_errors=True)
    for leftover in os.listdir(where):
        if leftover.startswith(os.path.basename(root)):
            shutil.rmtree(os.path.join(where, leftover), ignore_errors=True)
    row["rm_s"] = round(time.perf_counter() - t, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--payload")
    ap.add_argument("--n", default="1,4,8,14")
    ap.add_argument("--variants", default="ours256,ours_nock,ours0,builtin:t,builtin:p")
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    payload = None
    if args.payload:
        from bench_builtin import load_payload

        payload = load_payload(args.payload)
    region = Region(args.rows, 2 * MiB)
    os.makedirs(args.dir, exist_ok=True)
    rows = []
    for rnd in range(args.rounds):
        for n in [int(x) for x in args.n.split(",")]:
            for spec in args.variants.split(","):
                variant, _, mode = spec.partition(":")
                row = one(variant, mode or "p", n, region, args.dir, payload, args.blocks, f"{rnd}")
                row["round"] = rnd
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
