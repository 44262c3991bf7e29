"""What an I/O worker process costs in memory and start-up time, against the
size of the primary region it maps (docs/benchmarks.md, "Worker processes").

For each region size: a memfd primary of that size, an FsEngine with
io_workers=2 (start-up seconds: construction, i.e. spawn + map + hello),
then every row stored once (each worker touches the pages of the rows it
writes), then the workers' VmPTE (page tables) and VmRSS. No vLLM.

    python3 tools/worker_memory.py --dir /dev/shm/wm --gib 1 --gib 4 --gib 16 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import shutil
import sys
import time

if importlib.util.find_spec("llmkv_fs") is None:  # a checkout, not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_engine import IDENTITY, drive, make_keys

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.layout.paths import CacheLayout

BLOCK = 2 << 20


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure(directory: str, gib: float) -> dict:
    size = int(gib * (1 << 30)) // BLOCK * BLOCK
    fd = os.memfd_create("llmkv_worker_memory", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    primary = mmap.mmap(fd, size)
    os.close(fd)
    root = os.path.join(directory, f"wm-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    settings = TierSettings.from_mapping(
        {"root_dir": root, "io_workers": 2, "max_pending_store_blocks": 1 << 20}
    )
    started = time.perf_counter()
    engine = FsEngine(settings, CacheLayout.for_identity(root, IDENTITY), primary, BLOCK)
    startup = time.perf_counter() - started
    try:
        pids = engine.executor.worker_pids()
        before = [status_kib(p, "VmPTE") for p in pids]
        n = size // BLOCK
        seconds, _ = drive(engine, make_keys(n, f"wm-{gib}"), 64, False, 0.001, 0)
        after = [status_kib(p, "VmPTE") for p in pids]
        rss = [status_kib(p, "VmRSS") for p in pids]
    finally:
        engine.shutdown()
        shutil.rmtree(root, ignore_errors=True)
        primary.close()
    touched = sum(a - b for a, b in zip(after, before))  # both workers: every row once
    return {
        "region_gib": size / (1 << 30),
        "startup_s": startup,
        "pte_kib_idle": before,
        "pte_kib_after": after,
        "rss_kib_after": rss,
        "pte_kib_per_gib_touched": touched / (size / (1 << 30)),
        "store_gbps": size / seconds / 1e9,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--gib", action="append", type=float)
    p.add_argument("--json")
    args = p.parse_args()
    rows = [measure(args.dir, g) for g in args.gib or [0.25, 1.0]]
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
