"""What a lookup costs with several roots (issue 19): the existence check of
a key that is missing (its home root, then its second choice: two checks),
found at its home, and found at its second choice (written before its home
root was added). Engine only, no vLLM.

    python tools/bench_lookup_roots.py --dir /dev/shm/lr --dir /var/tmp/lr --keys 20000

Each --dir is a parent: 1 root (<dir>/r0) and 3 roots (<dir>/r0..r2) are
built below it. Prints microseconds per check (median of --rounds).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import time

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.layout.paths import CacheLayout, RunIdentity

BLOCK = 64 * 1024
IDENTITY = RunIdentity("bench/lookup", "float16", 16, 1, ((16, ("l0",)),))


def _engine(roots: list[str], n_rows: int) -> tuple[FsEngine, mmap.mmap]:
    primary = mmap.mmap(-1, n_rows * BLOCK)
    settings = TierSettings(
        root_dir=",".join(roots), path_sharding="by_block_hash", io_workers=0, lookup_threads=1
    )
    layouts = [CacheLayout.for_identity(r, IDENTITY) for r in roots]
    return FsEngine(settings, layouts, primary, BLOCK), primary


def _store(engine: FsEngine, keys: list[bytes]) -> None:
    for start in range(0, len(keys), 64):
        batch = keys[start : start + 64]
        engine.submit_store(start, batch, list(range(len(batch))))
        while engine.has_pending_work():
            engine.take_finished()
            time.sleep(0.001)
        engine.take_finished()


def _per_check_us(check, keys: list[bytes], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        for key in keys:
            check(key)
        samples.append((time.perf_counter() - started) / len(keys) * 1e6)
    return statistics.median(samples)


def measure(parent: str, n_keys: int, rounds: int) -> dict[str, float]:
    shutil.rmtree(parent, ignore_errors=True)
    keys = [os.urandom(32) for _ in range(n_keys)]
    absent = [os.urandom(32) for _ in range(n_keys)]
    one, _ = _engine([f"{parent}/r0"], 64)
    _store(one, keys)
    results = {
        "1 root: miss": _per_check_us(one.blockio.exists, absent, rounds),
        "1 root: hit": _per_check_us(one.blockio.exists, keys, rounds),
    }
    one.shutdown()
    two, _ = _engine([f"{parent}/r0", f"{parent}/r1"], 64)
    _store(two, keys)
    two.shutdown()
    three, _ = _engine([f"{parent}/r0", f"{parent}/r1", f"{parent}/r2"], 64)
    moved = [k for k in keys if three.placement.home(k) == 2]  # written before r2 existed
    stayed = [k for k in keys if three.placement.home(k) != 2]
    check = three._exists_on_its_roots
    results["3 roots: miss (2 checks)"] = _per_check_us(check, absent, rounds)
    results["3 roots: hit at home"] = _per_check_us(check, stayed, rounds)
    results["3 roots: hit at second choice"] = _per_check_us(check, moved, rounds)
    results["share moved to the added root"] = len(moved) / len(keys)
    three.shutdown()
    shutil.rmtree(parent, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", action="append", required=True)
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()}")
    for parent in args.dir:
        for name, value in measure(parent, args.keys, args.rounds).items():
            unit = "" if name.startswith("share") else " us"
            print(f"{parent}: {name}: {value:.3f}{unit}")


if __name__ == "__main__":
    main()
