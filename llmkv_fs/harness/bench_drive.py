"""The tiers under ``llmkv-fs bench``: both built by vLLM's real
``TieringOffloadingSpec`` over one Replica and driven as the tiering manager
drives a secondary tier (``TransferJob`` -> ``submit_store``/``submit_load``
-> poll ``get_finished_jobs``). Imports vLLM and numpy: ``bench`` imports this
module only when a benchmark runs, so ``llmkv-fs --help`` stays cheap."""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import time

import numpy as np
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from llmkv_fs.harness import driver
from llmkv_fs.harness.bench_media import KINDS, roots_of

__all__ = ["Bench"]

MIXED_LOAD_KEYS = 8  # distinct blocks the mixed run's small loads cycle through
MIXED_IDLE_LOADS = 8  # loads timed before the burst: the no-backlog baseline
_CTX = ReqContext(req_id="bench")


def _io_workers(value: str | int | None) -> dict[str, str | int]:
    return {} if value is None else {"io_workers": value}


class Bench:
    """Both tiers over one Replica for one (medium, block size, threads)."""

    def __init__(self, medium: str, block_mib: float, threads: int, args: argparse.Namespace):
        self.args, self.threads = args, threads
        self.block = int(block_mib * driver.MiB)
        self.n = args.jobs * args.blocks_per_job
        self.mixed_jobs = args.mixed_store_jobs or 4 * threads
        mixed_rows = self.mixed_jobs * args.blocks_per_job + MIXED_LOAD_KEYS if args.mixed else 0
        self.rows_used = max(self.n, mixed_rows)
        # A scratch folder per root; the built-in and the reference use the first.
        self.bases = [os.path.join(r, f"llmkv-bench-{os.getpid()}") for r in roots_of(medium)]
        self.base = self.bases[0]
        self.root_dirs = {
            "ours": [os.path.join(b, "ours") for b in self.bases],
            "builtin": [os.path.join(self.base, "builtin")],
        }
        for dirs in self.root_dirs.values():
            for root in dirs:
                os.makedirs(root, exist_ok=True)
        t = {"n_read_threads": threads, "n_write_threads": threads}
        sharding = {"path_sharding": "by_block_hash"} if len(self.bases) > 1 else {}
        cfg = driver.offloading_config(
            tiers=[
                driver.ours(
                    ",".join(self.root_dirs["ours"]),
                    **sharding,
                    checksum=args.checksum,
                    durability=args.durability,
                    **t,
                    **_io_workers(args.io_workers),
                ),
                driver.builtin(self.root_dirs["builtin"][0], **t),
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
        # Our view must go before vLLM unmaps the region (closed: rows is gone).
        self.rows = None  # type: ignore[assignment]
        self.replica.close()
        for base in self.bases:
            shutil.rmtree(base, ignore_errors=True)

    def clear(self, kind: str) -> None:
        """Remove the last run's blocks: the <hhh> fan-out folders of the rank
        dirs (config.json, leases and the rank dirs themselves stay)."""
        for root in self.root_dirs[kind]:
            for rank_dir in glob.glob(os.path.join(glob.escape(root), "*_r[0-9]*")):
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
