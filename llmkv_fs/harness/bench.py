"""``llmkv-fs bench``: llmkv_fs against vLLM's built-in fs tier, side by side,
with fio as the physical reference.

Both tiers are built by vLLM's real ``TieringOffloadingSpec`` over one real
``SharedOffloadRegion`` (one Replica holding both tiers: the same memoryview,
the same bytes) and driven as the tiering manager drives a secondary tier:
``TransferJob`` -> ``submit_store``/``submit_load`` -> poll
``get_finished_jobs`` every ``--poll-ms``. Per medium, block size and thread
count, each round runs ours and the built-in in alternating order (machine
drift cancels), each in its own directory under the same ``--dir``, then the
physical reference (bench_fio) at the same block size and concurrency.

Per tier and direction: GB/s (first submit -> last result seen), job latency
(submit -> result seen by a poll), scheduler-thread µs per block (time inside
submit_* and get_finished_jobs / blocks). ``--mixed`` adds loads submitted
while a store backlog is queued (the latency a promotion sees behind stores).

    llmkv-fs bench --dir /dev/shm/bench --dir /var/tmp/bench --threads 1 --threads 4

Several roots: a ``--dir`` given as a comma list is one medium
of several roots: ours stores over all of them (``path_sharding:
by_block_hash``), the built-in and the reference use the first root alone.
Where a medium of its first root alone runs too (``--dir /a --dir /a,/b``),
ours on several roots is also given against ours on one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from llmkv_fs.checks import int_between, option
from llmkv_fs.config import setting_option
from llmkv_fs.harness import bench_report
from llmkv_fs.harness.bench_media import KINDS, roots_of
from llmkv_fs.harness.machine import fs_of, machine_info

__all__ = ["add_arguments", "run_bench"]

_PAGE_MIB = 4096 / (1 << 20)
_COUNT = option(int_between(1, 1 << 20))  # jobs, blocks, rounds, loads


def _block_mib(text: str) -> float:
    """A chunk size in MiB that is a whole number of 4 KiB pages, 1/256
    (4 KiB) to 64: 0.0625 is 64 KiB, 0.5 is 512 KiB."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of MiB: {text!r}") from None
    pages = value / _PAGE_MIB
    if not (1 <= pages <= 64 * 256) or pages != int(pages):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a chunk must be a whole number of 4 KiB pages, 4 KiB to 64 MiB"
        )
    return value


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_cases(p)
    _add_tier_options(p)
    _add_mixed(p)
    _add_run_options(p)
    return p


def _add_cases(p: argparse.ArgumentParser) -> None:
    """Which cases run: media x block sizes x thread counts, and their size."""
    p.add_argument(
        "--dir",
        action="append",
        required=True,
        help="medium to test (repeat); a scratch folder is made and removed inside it. A comma "
        "list is one medium of several roots: ours shards blocks over them (path_sharding "
        "by_block_hash), the built-in and the reference use the first",
    )
    p.add_argument(
        "--block-mib",
        action="append",
        type=_block_mib,
        help="chunk size in MiB, whole 4 KiB pages: 0.0625 (64 KiB), 0.5, 2, 8 ... (repeat; "
        "default 2)",
    )
    p.add_argument(
        "--threads",
        action="append",
        type=setting_option("n_read_threads"),
        help="n_read_threads = n_write_threads of both tiers (repeat for a sweep; default 4)",
    )
    p.add_argument(
        "--jobs", type=_COUNT, default=8, help="jobs per direction per round (default 8)"
    )
    p.add_argument("--blocks-per-job", type=_COUNT, default=8, help="blocks per job (default 8)")
    p.add_argument("--rounds", type=_COUNT, default=3, help="alternating A/B rounds (default 3)")


def _add_tier_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checksum",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ours: write and verify xxh3 checksums (default on; --no-checksum)",
    )
    p.add_argument(
        "--durability",
        default="none",
        choices=("none", "file", "full"),
        help="ours: fsync policy (the built-in never fsyncs)",
    )


def _add_mixed(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--io-workers",
        type=setting_option("io_workers"),
        default=None,
        help='ours: the io_workers setting ("auto", 0 = threads, N processes; default: the '
        "tier's default)",
    )
    p.add_argument(
        "--mixed",
        action="store_true",
        help="also time small loads submitted during a store backlog",
    )
    p.add_argument(
        "--mixed-store-jobs",
        type=_COUNT,
        default=None,
        help="store jobs in the --mixed burst (default 4 x threads: twice the pool)",
    )
    p.add_argument(
        "--mixed-loads",
        type=_COUNT,
        default=200,
        help="most one-block loads timed per --mixed round (default 200)",
    )


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """The reference, polling, the page cache, and where results go."""
    p.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip the fio / Python physical reference",
    )
    p.add_argument(
        "--poll-ms",
        type=float,
        default=1.0,
        help="pause between get_finished_jobs polls (default 1 ms)",
    )
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache before each load phase (root)",
    )
    p.add_argument("--json", metavar="PATH", help="write every sample as JSON ('-': stdout)")
    p.add_argument("--plot-dir", metavar="DIR", help="write PNG plots (GB/s vs threads) here")


def add_root_scaling(cases: list[dict[str, Any]]) -> None:
    """Sets case["vs_one_root"] on every case of several roots: ours / ours on
    its first root alone (the case of that medium with the same block size
    and threads), where that ran too."""
    for case in cases:
        if len(case["roots"]) < 2:
            continue
        peer = next(
            (
                c
                for c in cases
                if c["roots"] == case["roots"][:1]
                and c["block_mib"] == case["block_mib"]
                and c["threads"] == case["threads"]
            ),
            None,
        )
        if peer is not None:
            case["vs_one_root"] = {
                d: case["tiers"]["ours"][d]["gbps"] / peer["tiers"]["ours"][d]["gbps"]
                for d in ("store", "load")
            }


def _pct(values: list[float], p: int) -> float | None:
    """Nearest-rank percentile (no interpolation between samples)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * p // 100) - 1))]


def _summary(runs: list[dict]) -> dict:
    lat = [x for r in runs for x in r["latencies_ms"]]
    return {
        "gbps": statistics.median(r["gbps"] for r in runs),
        "samples_gbps": [round(r["gbps"], 4) for r in runs],
        "p50_ms": _pct(lat, 50),
        "p99_ms": _pct(lat, 99),
        "sched_us_per_block": statistics.median(r["sched_us_per_block"] for r in runs),
        "submit_us_per_block": statistics.median(r["submit_us_per_block"] for r in runs),
        "samples_sched_us_per_block": [round(r["sched_us_per_block"], 2) for r in runs],
        "latencies_ms": [round(x, 3) for x in lat],
    }


def run_case(
    medium: str, block_mib: float, threads: int, args: argparse.Namespace
) -> dict[str, Any]:
    from llmkv_fs.harness.bench_drive import Bench

    bench = Bench(medium, block_mib, threads, args)
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    mixed: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    refs: list[dict[str, Any]] = []
    try:
        for round_no in range(args.rounds):
            order = KINDS if round_no % 2 == 0 else KINDS[::-1]
            for kind in order:
                samples[kind].append(bench.throughput(kind, round_no))
            if args.reference:
                from llmkv_fs.harness.bench_fio import physical_reference

                refs.append(
                    physical_reference(
                        os.path.join(bench.base, f"ref-{round_no}"),
                        bench.block,
                        bench.n,
                        2 * threads,
                    )
                )
            if args.mixed:
                for kind in order:
                    mixed[kind].append(bench.mixed(kind, round_no))
    finally:
        bench.close()
    roots = roots_of(medium)
    case: dict[str, Any] = {
        "medium": medium,
        "roots": roots,
        "fs": fs_of(roots[0]),
        "fs_roots": [fs_of(r) for r in roots],
        "block_mib": block_mib,
        "threads": threads,
        "rounds": args.rounds,
        "tiers": {
            k: {d: _summary([s[d] for s in samples[k]]) for d in ("store", "load")} for k in KINDS
        },
    }
    t = case["tiers"]
    case["ratio"] = {d: t["ours"][d]["gbps"] / t["builtin"][d]["gbps"] for d in ("store", "load")}
    if refs:
        case["reference"] = _reference_summary(refs)
        case["pct_of_reference"] = {
            k: {d: 100 * t[k][d]["gbps"] / case["reference"][d]["gbps"] for d in ("store", "load")}
            for k in KINDS
        }
    if args.mixed:
        case["mixed"] = _mixed_summary(mixed, bench.mixed_jobs, args.blocks_per_job)
    return case


def _reference_summary(refs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tool": refs[0]["tool"],
        "direct": refs[0]["direct"],
        "numjobs": refs[0]["numjobs"],
        **{
            d: {
                "gbps": statistics.median(r[f"{d}_gbps"] for r in refs),
                "samples_gbps": [round(r[f"{d}_gbps"], 4) for r in refs],
            }
            for d in ("store", "load")
        },
    }


def _mixed_summary(
    mixed: dict[str, list[dict[str, Any]]], store_jobs: int, blocks_per_job: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"store_jobs": store_jobs, "store_blocks": store_jobs * blocks_per_job}
    for k in KINDS:
        during = [x for m in mixed[k] for x in m["during_ms"]]
        idle = [x for m in mixed[k] for x in m["idle_ms"]]
        out[k] = {
            "n": len(during),
            "p50_ms": _pct(during, 50),
            "p99_ms": _pct(during, 99),
            "idle_p50_ms": _pct(idle, 50),
            "backlog_s": [round(m["backlog_s"], 4) for m in mixed[k]],
            "store_gbps": [round(m["store_gbps"], 4) for m in mixed[k]],
            "during_ms": [round(x, 3) for x in during],
            "idle_ms": [round(x, 3) for x in idle],
        }
    return out


def run_bench(args: argparse.Namespace) -> int:
    args.block_mib = args.block_mib or [2.0]
    args.threads = args.threads or [4]
    if args.plot_dir and bench_report.plotting_missing():
        print(
            f"# --plot-dir: plots will be skipped: {bench_report.plotting_missing()}",
            file=sys.stderr,
            flush=True,
        )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported
    all_roots = list(dict.fromkeys(r for medium in args.dir for r in roots_of(medium)))
    for root in all_roots:
        os.makedirs(root, exist_ok=True)
    result: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "machine": machine_info(all_roots),
        "cases": [],
    }
    log = sys.stderr
    for medium in args.dir:
        for block_mib in args.block_mib:
            for threads in args.threads:
                started = time.monotonic()
                case = run_case(medium, block_mib, threads, args)
                result["cases"].append(case)
                t = case["tiers"]
                print(
                    f"# {medium} {bench_report.chunk_size(block_mib)} {threads} threads: store "
                    f"{t['ours']['store']['gbps']:.2f}/{t['builtin']['store']['gbps']:.2f} load "
                    f"{t['ours']['load']['gbps']:.2f}/{t['builtin']['load']['gbps']:.2f} GB/s "
                    f"ours/built-in ({time.monotonic() - started:.1f}s)",
                    file=log,
                    flush=True,
                )
    add_root_scaling(result["cases"])
    table = bench_report.markdown(result)
    print(table, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.plot_dir:
        for path in bench_report.plot_all(result, args.plot_dir):
            print(f"# wrote {path}", file=log)
    if args.json:
        bench_report.write_json(result, args.json)
    return 0
