"""Side-by-side store/load throughput: llmkv_fs vs vLLM's built-in fs tier.

Both tiers are built by vLLM's real TieringOffloadingSpec over a real
SharedOffloadRegion and driven exactly as the tiering manager drives a
secondary tier (TransferJob -> submit_store / submit_load -> poll
get_finished_jobs), on the same directory, alternating A/B per round so
machine drift cancels. Each store round writes into an empty directory; each
load round reads back what the previous store round wrote.

    python tools/bench_tiers.py --dir /dev/shm/bench --dir /var/tmp/bench

Prints a table (and --json) with GB/s per direction and ours/built-in.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from llmkv_fs.tier.driver import (  # noqa: E402
    MiB,
    Replica,
    builtin,
    make_keys,
    offloading_config,
    ours,
)


def tier_config(kind: str, root: str, args) -> dict:
    threads = {"n_read_threads": args.threads, "n_write_threads": args.threads}
    if kind == "ours":
        return ours(root, checksum=args.checksum, durability=args.durability, **threads)
    return builtin(root, **threads)


def run_jobs(tier, jobs: list[TransferJob], load: bool) -> tuple[float, float]:
    """Submit all jobs at once, poll every millisecond until all finish.
    Returns (wall seconds, seconds spent inside the tier's scheduler-side
    calls: submit_* and get_finished_jobs)."""
    submit = tier.submit_load if load else tier.submit_store
    started = time.perf_counter()
    for job in jobs:
        submit(job)
    in_calls = time.perf_counter() - started
    pending = {job.job_id for job in jobs}
    while pending:
        call = time.perf_counter()
        results = list(tier.get_finished_jobs())
        in_calls += time.perf_counter() - call
        for result in results:
            if not result.success:
                raise RuntimeError(f"job {result.job_id} failed")
            pending.discard(result.job_id)
        if pending:
            time.sleep(0.001)
    return time.perf_counter() - started, in_calls


def bench_one(kind: str, root: str, args, round_no: int) -> dict[str, float]:
    n_blocks = args.jobs * args.blocks_per_job
    block_bytes = args.block_mib * MiB
    cfg = offloading_config(
        tiers=[tier_config(kind, root, args)], block_bytes=block_bytes,
        cpu_bytes=(n_blocks + 4) * block_bytes, engine_id=f"bench_{kind}_{os.getpid()}_{round_no}",
    )
    replica = Replica(cfg)
    try:
        tier = replica.tier
        rng = np.random.default_rng(round_no)
        replica.rows[:n_blocks] = rng.integers(-128, 127, size=replica.rows[:n_blocks].shape,
                                               dtype=np.int8)
        keys = make_keys(n_blocks, seed=f"bench-{round_no}")
        ctx = ReqContext(req_id="bench")

        def jobs(load: bool, first_id: int) -> list[TransferJob]:
            out = []
            for j in range(args.jobs):
                lo = j * args.blocks_per_job
                out.append(TransferJob(
                    job_id=first_id + j, keys=keys[lo:lo + args.blocks_per_job],
                    chunk_ids=np.arange(lo, lo + args.blocks_per_job, dtype=np.int64),
                    is_promotion=load, req_context=ctx))
            return out

        store_s, store_sched = run_jobs(tier, jobs(False, 0), load=False)
        expected = replica.rows[:n_blocks].copy()
        replica.rows[:n_blocks] = 0
        if args.drop_caches:
            os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
        load_s, load_sched = run_jobs(tier, jobs(True, 10_000), load=True)
        if not np.array_equal(replica.rows[:n_blocks], expected):
            raise RuntimeError(f"{kind}: loaded bytes differ from stored bytes")
        total = n_blocks * block_bytes
        return {"store_gbps": total / store_s / 1e9, "load_gbps": total / load_s / 1e9,
                "sched_us_per_block": (store_sched + load_sched) / (2 * n_blocks) * 1e6}
    finally:
        replica.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", action="append", required=True, help="medium to test (repeat)")
    parser.add_argument("--block-mib", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--blocks-per-job", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4, help="read and write threads each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checksum", action=argparse.BooleanOptionalAction, default=True,
                        help="ours: write and verify xxh3 checksums (default on)")
    parser.add_argument("--durability", default="none", choices=("none", "file", "full"),
                        help="ours: fsync policy (the built-in never fsyncs)")
    parser.add_argument("--drop-caches", action="store_true", help="drop page cache before loads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rows = []
    for medium in args.dir:
        samples: dict[str, list[dict[str, float]]] = {"ours": [], "builtin": []}
        for round_no in range(args.rounds):
            order = ("ours", "builtin") if round_no % 2 == 0 else ("builtin", "ours")
            for kind in order:
                root = os.path.join(medium, f"{kind}-{round_no}")
                os.makedirs(root, exist_ok=True)
                try:
                    samples[kind].append(bench_one(kind, root, args, round_no))
                finally:
                    shutil.rmtree(root, ignore_errors=True)
        row = {"medium": medium, "samples": samples}
        for kind, runs in samples.items():
            for metric in ("store_gbps", "load_gbps", "sched_us_per_block"):
                row[f"{kind}_{metric}"] = statistics.median(r[metric] for r in runs)
        for metric in ("store_gbps", "load_gbps"):
            row[f"ratio_{metric}"] = row[f"ours_{metric}"] / row[f"builtin_{metric}"]
        rows.append(row)

    if args.json:
        json.dump({"args": vars(args), "rows": rows, "cpus": os.cpu_count()}, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.jobs} jobs x {args.blocks_per_job} blocks x {args.block_mib} MiB, "
          f"{args.threads}+{args.threads} threads, ours: checksum={args.checksum} "
          f"durability={args.durability}, median of {args.rounds} alternating rounds, "
          f"{os.cpu_count()} CPUs")
    print(f"{'medium':<24} {'store ours':>10} {'built-in':>9} {'ratio':>6}   "
          f"{'load ours':>9} {'built-in':>9} {'ratio':>6}   (GB/s)   "
          f"{'sched us/block ours':>18} {'built-in':>8}")
    for r in rows:
        print(f"{r['medium']:<24} {r['ours_store_gbps']:>10.2f} {r['builtin_store_gbps']:>9.2f} "
              f"{r['ratio_store_gbps']:>5.2f}x   {r['ours_load_gbps']:>9.2f} "
              f"{r['builtin_load_gbps']:>9.2f} {r['ratio_load_gbps']:>5.2f}x   "
              f"{'':6} {r['ours_sched_us_per_block']:>18.1f} {r['builtin_sched_us_per_block']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
