"""Per-block cost of BlockIO.store, load and exists, one thread, for one or
more checkouts of llmkv_fs in the same run (issue 21: resolving every path
beneath the root by directory descriptors, before vs after).

    python3 tools/bench_blockio.py --dir /dev/shm/bb --checkout before=/tmp/base \
        --checkout after=. --sizes 64K,2M --blocks 400 --rounds 7

Each round runs every checkout in a fresh subprocess (its own PYTHONPATH),
in alternating order, on an emptied directory: it stores ``--blocks``
blocks of random keys (new fan-out directories, as in a young cache), then
loads them back and checks the bytes, then looks each one up (``exists``).
Options as the engine picks them on that volume (O_DIRECT where the probe
passes, 1 MiB hash pieces on tmpfs, checksum on, durability none). Reported:
the median over rounds of the wall-clock and of the process's CPU
microseconds per block, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time

KiB = 1 << 10
MiB = 1 << 20
# Per block: wall-clock and this process's CPU microseconds (the CPU figure
# is what the code costs; the wall figure also holds waiting for a core on
# a shared machine).
WHAT = ("store_us", "store_cpu_us", "load_us", "load_cpu_us", "exists_us", "exists_cpu_us")


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, unit in (("K", KiB), ("M", MiB)):
        if text.endswith(suffix):
            return int(text[:-1]) * unit
    return int(text)


def child(directory: str, block_size: int, n_blocks: int) -> dict[str, float]:
    """One measurement, run inside the checkout's interpreter."""
    from llmkv_fs.engine.block.blockio import BlockIO, IoOptions, probe_o_direct
    from llmkv_fs.engine.volume.prepare import prepare_volume
    from llmkv_fs.layout.fsinfo import filesystem_type
    from llmkv_fs.layout.paths import CacheLayout

    run_config = {"model_name": "bench/blockio", "block_size": block_size}
    layout = CacheLayout(directory, run_config, 0)
    prepared = prepare_volume(layout)
    rows = mmap.mmap(-1, block_size)
    rows[:] = os.urandom(block_size)
    row = memoryview(rows)
    memory_fs = filesystem_type(directory) in ("tmpfs", "ramfs")
    options = IoOptions(
        block_size=block_size,
        use_o_direct=probe_o_direct(layout.rank_dir),
        fsync_file=False,
        fsync_dir=False,
        checksum=True,
        hash_chunk=MiB if memory_fs else 0,
        root=prepared.root,
    )
    blockio = BlockIO(layout, options)
    keys = [os.urandom(32) + bytes(4) for _ in range(n_blocks)]
    blockio.store(os.urandom(32) + bytes(4), row)  # thread scratch, imports
    back = mmap.mmap(-1, block_size)
    view = memoryview(back)
    result: dict[str, float] = {"o_direct": options.use_o_direct}
    for what, op in (
        ("store", lambda key: blockio.store(key, row)),
        ("load", lambda key: blockio.load(key, view)),
        ("exists", blockio.exists),
    ):
        wall, cpu = time.perf_counter(), time.process_time()
        for key in keys:
            op(key)
        result[f"{what}_us"] = (time.perf_counter() - wall) / n_blocks * 1e6
        result[f"{what}_cpu_us"] = (time.process_time() - cpu) / n_blocks * 1e6
    assert back[:] == rows[:], "loaded bytes differ"
    assert all(blockio.exists(key) for key in keys)
    return result


def run_one(checkout: str, directory: str, block_size: int, n_blocks: int) -> dict[str, float]:
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    # The checkout first; whatever else PYTHONPATH holds (xxhash) after it.
    path = os.pathsep.join(filter(None, [os.path.abspath(checkout), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    argv = [sys.executable, os.path.abspath(__file__), "--child", directory]
    argv += ["--sizes", str(block_size), "--blocks", str(n_blocks)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{checkout}: {done.stderr}")
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/dev/shm/llmkv_bench_blockio")
    p.add_argument("--checkout", action="append", default=[], metavar="LABEL=PATH")
    p.add_argument("--sizes", default="64K,2M")
    p.add_argument("--blocks", type=int, default=400)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.child:
        print(json.dumps(child(args.child, sizes[0], args.blocks)))
        return
    checkouts = [c.split("=", 1) for c in args.checkout] or [["this", "."]]
    load_before = os.getloadavg()
    samples: dict[tuple[str, int, str], list[float]] = {}
    for r in range(args.rounds):
        order = checkouts if r % 2 == 0 else checkouts[::-1]
        for size in sizes:
            for label, path in order:
                got = run_one(path, args.dir, size, args.blocks)
                for what in WHAT:
                    samples.setdefault((label, size, what), []).append(got[what])
                samples.setdefault((label, size, "o_direct"), []).append(got["o_direct"])
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}")
    heads = ("store", "(cpu)", "load", "(cpu)", "lookup", "(cpu)")
    print(f"{'us/block':<10} {'block':>7} {' '.join(f'{h:>8}' for h in heads)}  o_direct")
    for size in sizes:
        for label, _path in checkouts:
            us = [statistics.median(samples[label, size, w]) for w in WHAT]
            direct = all(samples[label, size, "o_direct"])
            cells = " ".join(f"{u:>8.1f}" for u in us)
            print(f"{label:<10} {size // KiB:>6}K {cells}  {direct}")
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
