"""issue 20: per-block worker CPU / off-CPU in the real engine (tools/profile_engine.py's
one_variant), variants for the store investigation. Run from tools/i20 with
PYTHONPATH=pkg (cwd must not hold an llmkv_fs: workers are spawned with -c)."""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "bench"))

import profile_engine as pe  # noqa: E402
from bench_support import Primary  # noqa: E402


class Args:
    engine_blocks = 2048
    io_workers = "auto"


def main() -> None:
    where = sys.argv[1]
    variants = sys.argv[2].split(",")
    rounds = int(sys.argv[3])
    out_path = sys.argv[4]
    block = 2 << 20
    primary = Primary(Args.engine_blocks, block, False)
    from llmkv_fs.engine.workers import crew, executor

    results: dict = {}
    saved = dict(os.environ)
    try:
        for rnd in range(rounds):
            for v in variants if rnd % 2 == 0 else variants[::-1]:
                os.environ.clear()
                os.environ.update(saved)
                depth = 2
                base = v
                if v == "before":
                    os.environ["I20_STORE_ORDER"] = "before"
                    base = "workers"
                if v.startswith("depth"):
                    depth = int(v[5:])
                    base = "workers"
                crew.DEPTH = executor.DEPTH = depth
                from llmkv_fs.engine.block import io_setup

                io_setup._HASH_CHUNK_WORKERS = 256 << 10
                if v == "h512":
                    io_setup._HASH_CHUNK_WORKERS = 512 << 10
                    base = "workers"
                os.makedirs(where, exist_ok=True)
                r = pe.one_variant(Args, where, primary, block, base)
                results.setdefault(v, []).append(r)
                s = r["steady store"]
                print(
                    v,
                    rnd,
                    {k: round(r[p]["gbps"], 2) for p in r if isinstance(r[p], dict) for k in [p]},
                    "steady store cpu/off/runq",
                    round(s["worker_cpu_us"]),
                    round(s["worker_offcpu_us"]),
                    round(s["worker_runq_us"]),
                    "cond",
                    round(s.get("conductor_cpu_us", 0), 1),
                    flush=True,
                )
                shutil.rmtree(where, ignore_errors=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        primary.close()
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
