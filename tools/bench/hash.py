"""The checksum's compute alone: xxh3-64 of 2 MiB blocks fed in the pieces the
engine's workers use (``engine/startup/io_setup._HASH_PIECE``), by the
xxhash that this interpreter imports, in N processes at once.

``hot``: every block is the same 2 MiB, in cache (what write-then-hash sees:
the piece was just copied by the kernel). ``cold``: blocks walk a region far
larger than the caches (what a hash before the write saw). Run it twice with
different builds on PYTHONPATH to compare them, e.g. python-xxhash 4.0 (SSE2
only) against 4.1 (SSE2 / AVX2 / AVX-512 chosen at run time):

    python3 -m tools.bench.hash --procs 1 --procs 14
    PYTHONPATH=/path/to/xxhash-4.1 python3 -m tools.bench.hash --procs 1 --procs 14

Prints one JSON line per (processes, kind): the xxhash version, GB/s per
process (median of --rounds) and in all. Imports xxhash, the stdlib and the
engine's piece size (from a checkout too), so it runs on the lent machine as
it is.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time

import xxhash

from llmkv_fs.engine.startup.io_setup import _HASH_PIECE as PIECE

BLOCK = 2 << 20


def _hash_rate(kind: str, region_mib: int, seconds: float) -> float:
    """GB/s of one process hashing blocks for about ``seconds``."""
    size = BLOCK if kind == "hot" else region_mib << 20
    region = memoryview(bytearray(os.urandom(1 << 20)) * (size >> 20))
    blocks = size // BLOCK
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        base = (done % blocks) * BLOCK
        hasher = xxhash.xxh3_64()
        for offset in range(base, base + BLOCK, PIECE):
            hasher.update(region[offset : offset + PIECE])
        hasher.intdigest()
        done += 1
    return done * BLOCK / (time.perf_counter() - start) / 1e9


def _measure(procs: int, kind: str, region_mib: int, seconds: float) -> list[float]:
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(procs) as pool:
        return pool.starmap(_hash_rate, [(kind, region_mib, seconds)] * procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, action="append", help="processes at once (repeat)")
    parser.add_argument("--kind", choices=("hot", "cold"), action="append")
    parser.add_argument("--region-mib", type=int, default=512, help="cold: MiB walked per process")
    parser.add_argument("--seconds", type=float, default=1.0, help="per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for procs in args.procs or [1]:
        for kind in args.kind or ["hot", "cold"]:
            measure = (procs, kind, args.region_mib, args.seconds)
            rounds = [_measure(*measure) for _ in range(args.rounds)]
            per_process = statistics.median(statistics.median(r) for r in rounds)
            total = statistics.median(sum(r) for r in rounds)
            print(
                json.dumps(
                    {
                        "xxhash": xxhash.VERSION,
                        "procs": procs,
                        "kind": kind,
                        "gbps_per_process": round(per_process, 2),
                        "gbps_total": round(total, 2),
                        "load": os.getloadavg()[0],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
