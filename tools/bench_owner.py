"""Scheduler-side cost of the engine: microseconds of the owner thread (the
vLLM scheduler / tier-poll thread) per block, while the I/O threads really
move blocks on a real directory. Imports nothing from vLLM or torch.

    python3 tools/bench_owner.py --dir /dev/shm/owner --threads 4

Transfers: every job is submitted, then take_finished is polled every
--poll-ms (as vLLM's tier-poll thread does). The owner's time inside those
calls -- including waiting for the GIL held by I/O threads, which is what
the scheduler pays -- is divided by the blocks moved; empty polls count too.
Lookups: during the same transfers, each poll also looks up
--lookups-per-step keys and ends the step; reported per lookup call.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import shutil
import statistics
import sys
import time

if importlib.util.find_spec("llmkv_fs") is None:  # a checkout, not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.layout.paths import CacheLayout, RunIdentity

IDENTITY = RunIdentity(
    model_name="bench/owner",
    dtype="bfloat16",
    tokens_per_hash=16,
    blocks_per_file=1,
    kv_cache_groups=((16, ("layer.0",)),),
)


def run(args, direction: str, engine: FsEngine, keys: list[bytes], jobs: int) -> dict:
    per_job = args.blocks_per_job
    in_calls = 0.0
    in_lookups = 0.0
    lookups = 0
    polls = 0
    started = time.perf_counter()
    pending = set()
    for j in range(jobs):
        chunk_ids = list(range(j * per_job, (j + 1) * per_job))
        job_keys = keys[j * per_job : (j + 1) * per_job]
        t = time.perf_counter()
        if direction == "store":
            engine.submit_store(j, job_keys, chunk_ids)
        else:
            engine.submit_load(j, job_keys, chunk_ids)
        in_calls += time.perf_counter() - t
        pending.add(j)
    while pending:
        t = time.perf_counter()
        for key in keys[: args.lookups_per_step]:
            engine.lookup(key, "bench-request")
        engine.end_step()
        in_lookups += time.perf_counter() - t
        lookups += args.lookups_per_step
        t = time.perf_counter()
        for job in engine.take_finished():
            assert job.success, job
            pending.discard(job.job_id)
        in_calls += time.perf_counter() - t
        polls += 1
        time.sleep(args.poll_ms / 1000)
    wall = time.perf_counter() - started
    blocks = jobs * per_job
    return {
        "direction": direction,
        "blocks": blocks,
        "wall_s": wall,
        "polls": polls,
        "owner_us_per_block": in_calls / blocks * 1e6,
        "us_per_lookup": in_lookups / max(1, lookups) * 1e6,
        "gbps": blocks * args.block_mib * (1 << 20) / wall / 1e9,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--threads", type=int, action="append")
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--blocks-per-job", type=int, default=8)
    parser.add_argument("--block-mib", type=float, default=2)
    parser.add_argument("--poll-ms", type=float, default=1.0)
    parser.add_argument("--lookups-per-step", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    block = int(args.block_mib * (1 << 20))
    n_blocks = args.jobs * args.blocks_per_job
    results = []
    for threads in args.threads or [4]:
        for _ in range(args.rounds):
            root = os.path.join(args.dir, f"owner-{threads}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            layout = CacheLayout.for_identity(root, IDENTITY)
            primary = mmap.mmap(-1, n_blocks * block)
            engine = FsEngine(
                TierSettings(root_dir=root, n_read_threads=threads, n_write_threads=threads),
                layout,
                primary,
                block,
            )
            keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(n_blocks)]
            for direction in ("store", "load"):
                results.append(
                    {"threads": threads, **run(args, direction, engine, keys, args.jobs)}
                )
            engine.shutdown()
            primary.close()
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"cpus={os.cpu_count()} dir={args.dir} block={args.block_mib} MiB "
        f"jobs={args.jobs}x{args.blocks_per_job} poll={args.poll_ms} ms"
    )
    print(
        "| threads | direction | owner µs/block (median) | µs per lookup (median) | GB/s (median) |"
    )
    print("|---|---|---|---|---|")
    for threads in args.threads or [4]:
        for direction in ("store", "load"):
            rows = [r for r in results if r["threads"] == threads and r["direction"] == direction]
            print(
                f"| {threads} | {direction} | "
                f"{statistics.median(r['owner_us_per_block'] for r in rows):.1f} | "
                f"{statistics.median(r['us_per_lookup'] for r in rows):.2f} | "
                f"{statistics.median(r['gbps'] for r in rows):.2f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
