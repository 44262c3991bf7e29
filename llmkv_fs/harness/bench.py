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
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys
import time

from llmkv_fs.harness import bench_report

# vLLM, numpy and the engine are imported by _import_heavy() when a benchmark
# runs, so building the parser (``llmkv-fs --help``) stays cheap.
np = TransferJob = driver = _CTX = None

__all__ = ["add_arguments", "run_bench"]

KINDS = ("ours", "builtin")
BLOCK_MIB_CHOICES = (0.5, 2.0, 8.0)
MIXED_LOAD_KEYS = 8  # distinct blocks the mixed run's small loads cycle through
MIXED_IDLE_LOADS = 8  # loads timed before the burst: the no-backlog baseline


def _import_heavy() -> None:
    global np, TransferJob, driver, _CTX
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import numpy
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob as job_cls

    from llmkv_fs.harness import driver as drv

    np, TransferJob, driver, _CTX = numpy, job_cls, drv, ReqContext(req_id="bench")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--dir",
        action="append",
        required=True,
        help="medium to test (repeat); a scratch folder is made and removed inside it",
    )
    p.add_argument(
        "--block-mib",
        action="append",
        type=float,
        choices=BLOCK_MIB_CHOICES,
        help="chunk size in MiB: 0.5, 2 or 8 (repeat; default 2)",
    )
    p.add_argument(
        "--threads",
        action="append",
        type=int,
        help="n_read_threads = n_write_threads of both tiers (repeat for a sweep; default 4)",
    )
    p.add_argument("--jobs", type=int, default=8, help="jobs per direction per round (default 8)")
    p.add_argument("--blocks-per-job", type=int, default=8, help="blocks per job (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="alternating A/B rounds (default 3)")
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
    p.add_argument(
        "--io-workers",
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
        type=int,
        default=None,
        help="store jobs in the --mixed burst (default 4 x threads: twice the pool)",
    )
    p.add_argument(
        "--mixed-loads",
        type=int,
        default=200,
        help="most one-block loads timed per --mixed round (default 200)",
    )
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
    return p


def _pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (no interpolation between samples)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * p // 100) - 1))]


def _io_workers(text: str | None) -> dict:
    if text is None:
        return {}
    return {"io_workers": text if text == "auto" else int(text)}


class _Bench:
    """Both tiers over one Replica for one (medium, block size, threads)."""

    def __init__(self, medium: str, block_mib: float, threads: int, args: argparse.Namespace):
        self.args, self.threads = args, threads
        self.block = int(block_mib * driver.MiB)
        self.n = args.jobs * args.blocks_per_job
        self.mixed_jobs = args.mixed_store_jobs or 4 * threads
        mixed_rows = self.mixed_jobs * args.blocks_per_job + MIXED_LOAD_KEYS if args.mixed else 0
        self.rows_used = max(self.n, mixed_rows)
        self.base = os.path.join(medium, f"llmkv-bench-{os.getpid()}")
        self.roots = {k: os.path.join(self.base, k) for k in KINDS}
        for root in self.roots.values():
            os.makedirs(root, exist_ok=True)
        t = {"n_read_threads": threads, "n_write_threads": threads}
        cfg = driver.offloading_config(
            tiers=[
                driver.ours(
                    self.roots["ours"],
                    checksum=args.checksum,
                    durability=args.durability,
                    **t,
                    **_io_workers(args.io_workers),
                ),
                driver.builtin(self.roots["builtin"], **t),
            ],
            block_bytes=self.block,
            cpu_bytes=(self.rows_used + 4) * self.block,
            engine_id=f"llmkv_bench_{os.getpid()}_{self.block}_{threads}",
        )
        self.replica = driver.Replica(cfg)
        self.tiers = dict(zip(KINDS, self.replica.manager.secondary_tiers))
        got = {k: type(v).__module__ for k, v in self.tiers.items()}
        if not (got["ours"].startswith("llmkv_fs") and got["builtin"].startswith("vllm.")):
            raise RuntimeError(f"tier classes are not ours + vLLM's built-in: {got}")
        self.rows = self.replica.rows
        # Random bytes once per case; every round stores them under new keys.
        rng = np.random.default_rng(self.block + threads)
        self.rows[: self.rows_used] = rng.integers(
            -128, 127, size=self.rows[: self.rows_used].shape, dtype=np.int8
        )
        self.expected = self.rows[: self.rows_used].copy()
        self._next_id = 0

    def close(self) -> None:
        self.rows = None  # our view must go before vLLM unmaps the region
        self.replica.close()
        shutil.rmtree(self.base, ignore_errors=True)

    def clear(self, kind: str) -> None:
        """Remove the last run's blocks: the <hhh> fan-out folders of the rank
        dirs (config.json, leases and the rank dirs themselves stay)."""
        for rank_dir in glob.glob(os.path.join(glob.escape(self.roots[kind]), "*_r[0-9]*")):
            for child in os.listdir(rank_dir):
                if len(child) == 3 and all(c in "0123456789abcdef" for c in child):
                    shutil.rmtree(os.path.join(rank_dir, child), ignore_errors=True)

    # -- one batch of jobs, driven as the tiering manager does ----------------------

    def jobs(self, keys: list[bytes], first_row: int, per_job: int, load: bool) -> list:
        out = []
        for lo in range(0, len(keys), per_job):
            out.append(
                TransferJob(
                    job_id=self._next_id,
                    keys=keys[lo : lo + per_job],
                    chunk_ids=np.arange(
                        first_row + lo, first_row + min(lo + per_job, len(keys)), dtype=np.int64
                    ),
                    is_promotion=load,
                    req_context=_CTX,
                )
            )
            self._next_id += 1
        return out

    def drive(self, tier, jobs: list, load: bool) -> dict:
        """Submit all jobs, poll until all finish. Wall time runs from the first
        submit to the poll that returned the last result."""
        submit = tier.submit_load if load else tier.submit_store
        poll_s = self.args.poll_ms / 1000
        sent: dict[int, float] = {}
        in_submit = in_poll = 0.0
        started = time.perf_counter()
        for job in jobs:
            a = time.perf_counter()
            submit(job)
            in_submit += time.perf_counter() - a
            sent[job.job_id] = a
        latencies, seen = [], started
        while sent:
            a = time.perf_counter()
            results = list(tier.get_finished_jobs())
            seen = time.perf_counter()
            in_poll += seen - a
            for res in results:
                if not res.success:
                    raise RuntimeError(f"{'load' if load else 'store'} job {res.job_id} failed")
                latencies.append(seen - sent.pop(res.job_id))
            if sent:
                time.sleep(poll_s)
        blocks = sum(len(j.keys) for j in jobs)
        wall = seen - started
        return {
            "gbps": blocks * self.block / wall / 1e9,
            "wall_s": wall,
            "latencies_ms": [x * 1e3 for x in latencies],
            "sched_us_per_block": (in_submit + in_poll) / blocks * 1e6,
            "submit_us_per_block": in_submit / blocks * 1e6,
        }

    # -- throughput --------------------------------------------------------------------

    def throughput(self, kind: str, round_no: int) -> dict[str, dict]:
        tier, n, per_job = self.tiers[kind], self.n, self.args.blocks_per_job
        keys = driver.make_keys(n, seed=f"bench-{kind}-{round_no}")
        store = self.drive(tier, self.jobs(keys, 0, per_job, load=False), load=False)
        self.rows[:n] = 0
        if self.args.drop_caches:
            os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
        load = self.drive(tier, self.jobs(keys, 0, per_job, load=True), load=True)
        if not np.array_equal(self.rows[:n], self.expected[:n]):
            raise RuntimeError(f"{kind}: loaded bytes differ from stored bytes")
        self.clear(kind)
        return {"store": store, "load": load}

    # -- loads behind a store backlog ----------------------------------------------

    def mixed(self, kind: str, round_no: int) -> dict:
        tier, bpj = self.tiers[kind], self.args.blocks_per_job
        poll_s = self.args.poll_ms / 1000
        burst_blocks = self.mixed_jobs * bpj
        first_load_row = burst_blocks
        load_keys = driver.make_keys(MIXED_LOAD_KEYS, seed=f"mixed-load-{kind}-{round_no}")
        self.drive(
            tier, self.jobs(load_keys, first_load_row, MIXED_LOAD_KEYS, load=False), load=False
        )

        def one_load(i: int):
            row = first_load_row + i % MIXED_LOAD_KEYS
            self.rows[row] = 0
            return self.jobs([load_keys[i % MIXED_LOAD_KEYS]], row, 1, load=True)[0]

        def check(job) -> None:
            row = int(job.chunk_ids[0])
            if not np.array_equal(self.rows[row], self.expected[row]):
                raise RuntimeError(f"{kind}: mixed load returned wrong bytes")

        idle = []
        for i in range(MIXED_IDLE_LOADS):
            job = one_load(i)
            idle += self.drive(tier, [job], load=True)["latencies_ms"]
            check(job)
        burst_keys = driver.make_keys(burst_blocks, seed=f"mixed-burst-{kind}-{round_no}")
        stores = self.jobs(burst_keys, 0, bpj, load=False)
        started = time.perf_counter()
        for job in stores:
            tier.submit_store(job)
        pending_stores = {job.job_id for job in stores}
        during, i, load_job, sent = [], 0, None, 0.0
        while pending_stores or load_job is not None:
            if load_job is None and pending_stores and i < self.args.mixed_loads:
                load_job, sent = one_load(i), time.perf_counter()
                tier.submit_load(load_job)
                i += 1
            results = list(tier.get_finished_jobs())
            seen = time.perf_counter()
            for res in results:
                if not res.success:
                    raise RuntimeError(f"{kind}: mixed job {res.job_id} failed")
                if load_job is not None and res.job_id == load_job.job_id:
                    during.append((seen - sent) * 1e3)
                    check(load_job)
                    load_job = None
                else:
                    pending_stores.discard(res.job_id)
                    if not pending_stores:
                        backlog_s = seen - started
            if not results:
                time.sleep(poll_s)
        self.clear(kind)
        return {
            "idle_ms": idle,
            "during_ms": during,
            "backlog_s": backlog_s,
            "store_gbps": burst_blocks * self.block / backlog_s / 1e9,
        }


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


def run_case(medium: str, block_mib: float, threads: int, args: argparse.Namespace) -> dict:
    bench = _Bench(medium, block_mib, threads, args)
    samples: dict[str, list[dict]] = {k: [] for k in KINDS}
    mixed: dict[str, list[dict]] = {k: [] for k in KINDS}
    refs: list[dict] = []
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
    case = {
        "medium": medium,
        "fs": bench_report.fs_of(medium),
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
        case["reference"] = {
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
        case["pct_of_reference"] = {
            k: {d: 100 * t[k][d]["gbps"] / case["reference"][d]["gbps"] for d in ("store", "load")}
            for k in KINDS
        }
    if args.mixed:
        case["mixed"] = {
            "store_jobs": bench.mixed_jobs,
            "store_blocks": bench.mixed_jobs * args.blocks_per_job,
        }
        for k in KINDS:
            during = [x for m in mixed[k] for x in m["during_ms"]]
            idle = [x for m in mixed[k] for x in m["idle_ms"]]
            case["mixed"][k] = {
                "n": len(during),
                "p50_ms": _pct(during, 50),
                "p99_ms": _pct(during, 99),
                "idle_p50_ms": _pct(idle, 50),
                "backlog_s": [round(m["backlog_s"], 4) for m in mixed[k]],
                "store_gbps": [round(m["store_gbps"], 4) for m in mixed[k]],
                "during_ms": [round(x, 3) for x in during],
                "idle_ms": [round(x, 3) for x in idle],
            }
    return case


def run_bench(args: argparse.Namespace) -> int:
    args.block_mib = args.block_mib or [2.0]
    args.threads = args.threads or [4]
    if min(args.threads) < 1 or args.jobs < 1 or args.blocks_per_job < 1 or args.rounds < 1:
        raise SystemExit("--threads, --jobs, --blocks-per-job and --rounds must be >= 1")
    if args.plot_dir and bench_report.plotting_missing():
        print(
            f"# --plot-dir: plots will be skipped: {bench_report.plotting_missing()}",
            file=sys.stderr,
            flush=True,
        )
    _import_heavy()
    for medium in args.dir:
        os.makedirs(medium, exist_ok=True)
    result = {
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "machine": bench_report.machine_info(args.dir),
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
                    f"# {medium} {block_mib:g} MiB {threads} threads: store "
                    f"{t['ours']['store']['gbps']:.2f}/{t['builtin']['store']['gbps']:.2f} load "
                    f"{t['ours']['load']['gbps']:.2f}/{t['builtin']['load']['gbps']:.2f} GB/s "
                    f"ours/built-in ({time.monotonic() - started:.1f}s)",
                    file=log,
                    flush=True,
                )
    table = bench_report.markdown(result)
    print(table, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.plot_dir:
        for path in bench_report.plot_all(result, args.plot_dir):
            print(f"# wrote {path}", file=log)
    if args.json:
        bench_report.write_json(result, args.json)
    return 0
