"""``llmkv-fs doctor`` beside ``llmkv-fs stats`` on one large volume: wall
time and peak memory (the child's max RSS) of each, several rounds,
alternating, on a volume of tiny block files in two deployments of one
model that differ in block size (what doctor is for). Prints one JSON
line per run and a summary with the load average before and after.
``python -m tools.bench.doctor --blocks 100000``."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from llmkv_fs.layout.names import offload_key
from llmkv_fs.layout.paths import CacheLayout, RunIdentity
from llmkv_fs.volume.run_config import ensure_run_config


def identity(block_size: int) -> RunIdentity:
    return RunIdentity("acme/llama", "bfloat16", block_size, 1, ((block_size, ("layer.0",)),))


def fill(root: str, blocks: int) -> None:
    """``blocks`` one-byte block files, split between two deployments (block
    size 16 and 32) of one model."""
    os.makedirs(root, exist_ok=True)
    for part, block_size in enumerate((16, 32)):
        layout = CacheLayout.for_identity(root, identity(block_size))
        ensure_run_config(layout)
        for i in range(part, blocks, 2):
            key = offload_key(hashlib.sha256(str(i).encode()).digest())
            path = layout.block_path(key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"x")


def measured(argv: list[str]) -> dict:
    """One run of ``python -m llmkv_fs ARGV`` under /usr/bin/time."""
    out = subprocess.run(
        ["/usr/bin/time", "-f", "TIME %e %M", sys.executable, "-m", "llmkv_fs", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    line = [x for x in out.stderr.splitlines() if x.startswith("TIME ")][-1]
    _, seconds, kib = line.split()
    return {
        "argv": argv[0],
        "rc": out.returncode,
        "s": float(seconds),
        "max_rss_mib": int(kib) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="where to build the volume (default: a temp dir)"
    )
    args = parser.parse_args()
    base = tempfile.mkdtemp(dir=args.dir)
    root = os.path.join(base, "kv")
    try:
        fill(root, args.blocks)
        load_before = os.getloadavg()
        runs: dict[str, list[dict]] = {"stats": [], "doctor": [], "doctor --walk": []}
        for _ in range(args.rounds):
            for name, argv in (
                ("stats", ["stats", root, "--json"]),
                ("doctor", ["doctor", root, "--json"]),
                ("doctor --walk", ["doctor", root, "--json", "--walk"]),
            ):
                run = measured(argv)
                runs[name].append(run)
                print(json.dumps({"case": name, **run}), flush=True)
        load_after = os.getloadavg()
        stats_s = statistics.median(r["s"] for r in runs["stats"])
        stats_mib = statistics.median(r["max_rss_mib"] for r in runs["stats"])
        summary = {
            name: {
                "median_s": statistics.median(r["s"] for r in rs),
                "median_max_rss_mib": statistics.median(r["max_rss_mib"] for r in rs),
                "time_vs_stats": statistics.median(r["s"] for r in rs) / stats_s,
                "memory_vs_stats": statistics.median(r["max_rss_mib"] for r in rs) / stats_mib,
            }
            for name, rs in runs.items()
        }
        print(
            json.dumps(
                {
                    "blocks": args.blocks,
                    "rounds": args.rounds,
                    "load_before": load_before,
                    "load_after": load_after,
                    "summary": summary,
                    "at": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
            )
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
