"""Engine-only scaling benchmark: FsEngine store/load GB/s against I/O threads,
NUMA-pinned against unpinned. Imports nothing from vLLM or torch (only
llmkv_fs.engine, llmkv_fs.layout, llmkv_fs.config and the stdlib), so it runs
on any machine with Python 3.10+ and xxhash, e.g. a big box without vLLM:

    python3 tools/bench_engine.py --dir /mnt/nvme/bench --json out.json

The primary buffer is an anonymous mmap (or a /dev/shm file with --shm, like
vLLM's SharedOffloadRegion). Each (threads, numa_node) configuration gets a
fresh engine and an empty directory, stores every block, then loads them back
into the zeroed buffer and compares bytes; rounds alternate the order of the
numa settings. ``threads`` is n_read_threads = n_write_threads, so 2x that
many threads serve a one-direction burst.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import time

if importlib.util.find_spec("llmkv_fs") is None:  # a checkout, not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.engine.numa import format_cpulist, read_topology
from llmkv_fs.layout.fsinfo import mount_of
from llmkv_fs.layout.paths import CacheLayout, RunIdentity

MiB = 1 << 20
IDENTITY = RunIdentity(
    model_name="bench/engine",
    dtype="bfloat16",
    tokens_per_hash=16,
    blocks_per_file=1,
    kv_cache_groups=((16, ("layer.0", "layer.1")),),
)


def numa_setting(text: str) -> str | int:
    if text in ("auto", "off"):
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"numa setting must be auto, off or a node id, not {text!r}")


def fs_of(path: str) -> str:
    mount = mount_of(path)
    return "?" if mount is None else f"{mount.fstype} ({mount.device} on {mount.mount_point})"


def machine(dirs: list[str]) -> dict:
    topo = read_topology()
    model = "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?"
            )
    except OSError:
        pass
    with open("/proc/meminfo", encoding="ascii") as f:
        ram = int(f.readline().split()[1]) / (1 << 20)
    return {
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "ram_gib": round(ram, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numa_nodes": {str(n): format_cpulist(c) for n, c in sorted(topo.nodes.items())},
        "allowed_cpus": format_cpulist(topo.allowed_cpus),
        "media": {d: fs_of(d) for d in dirs},
    }


def make_keys(n: int, seed: str) -> list[bytes]:
    # An OffloadKey: block hash + 4-byte big-endian KV group index.
    return [hashlib.sha256(f"{seed}-{i}".encode()).digest() + b"\0\0\0\0" for i in range(n)]


class Primary:
    """The CPU tier stand-in: nblocks rows of block bytes, page aligned."""

    def __init__(self, nblocks: int, block: int, shm: bool):
        self.size, self.path = nblocks * block, None
        if shm:
            self.path = f"/dev/shm/llmkv_bench_engine_{os.getpid()}.mmap"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, self.size)
                self.mm = mmap.mmap(fd, self.size)
            finally:
                os.close(fd)
        else:
            self.mm = mmap.mmap(-1, self.size)
        seed = os.urandom(block)
        for i in range(nblocks):  # distinct rows: the index up front
            self.mm[i * block : (i + 1) * block] = i.to_bytes(8, "little") + seed[8:]
        self.expected = self.mm[:]

    def zero(self) -> None:
        self.mm.seek(0)
        chunk = bytes(min(self.size, 64 * MiB))
        for off in range(0, self.size, len(chunk)):
            self.mm[off : off + len(chunk)] = chunk[: self.size - off]

    def close(self) -> None:
        self.mm.close()
        if self.path:
            os.unlink(self.path)


def drive(
    engine: FsEngine, keys: list[bytes], per_job: int, load: bool, poll_s: float, first_id: int
) -> float:
    """Submit every block as jobs of ``per_job``; poll until all finish. Seconds."""
    pending = set()
    started = time.perf_counter()
    for job_id, lo in enumerate(range(0, len(keys), per_job), start=first_id):
        chunk_ids = list(range(lo, min(lo + per_job, len(keys))))
        if load:
            engine.submit_load(job_id, keys[lo : lo + per_job], chunk_ids)
        elif not engine.submit_store(job_id, keys[lo : lo + per_job], chunk_ids):
            raise RuntimeError("store queue full: raise --blocks or max_pending_store_blocks")
        pending.add(job_id)
    while pending:
        for job in engine.take_finished():
            if job.failed:
                raise RuntimeError(
                    f"{'load' if load else 'store'} job {job.job_id}: "
                    f"{len(job.failed)} blocks failed ({dict(engine.counters)})"
                )
            pending.discard(job.job_id)
        if pending:
            time.sleep(poll_s)
    return time.perf_counter() - started


def one_run(args, medium: str, primary: Primary, threads: int, numa, round_no: int) -> dict:
    block, n = int(args.block_mib * MiB), args.blocks
    root = os.path.join(medium, f"llmkv-bench-engine-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    layout = CacheLayout.for_identity(root, IDENTITY)
    settings = TierSettings.from_mapping(
        {
            "root_dir": root,
            "n_read_threads": threads,
            "n_write_threads": threads,
            "numa_node": numa,
            "checksum": args.checksum,
            "durability": args.durability,
            "max_pending_store_blocks": max(1024, n),
        }
    )
    engine = FsEngine(settings, layout, primary.mm, block)
    try:
        keys = make_keys(n, f"{threads}-{numa}-{round_no}")
        store_s = drive(engine, keys, args.blocks_per_job, False, args.poll_ms / 1000, 0)
        primary.zero()
        load_s = drive(engine, keys, args.blocks_per_job, True, args.poll_ms / 1000, 1 << 20)
        if primary.mm[:] != primary.expected:
            raise RuntimeError("loaded bytes differ from stored bytes")
        return {
            "store_gbps": n * block / store_s / 1e9,
            "load_gbps": n * block / load_s / 1e9,
            "pinning": engine.pinning.reason,
            "o_direct": engine.use_o_direct,
        }
    finally:
        engine.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", action="append", required=True, help="medium (repeat)")
    p.add_argument("--threads", action="append", type=int, help="sweep (default 1 2 4 8 16)")
    p.add_argument(
        "--numa",
        action="append",
        type=numa_setting,
        help='numa_node settings to compare (repeat; default "off" and "auto")',
    )
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--blocks", type=int, default=256, help="blocks per direction per run")
    p.add_argument("--blocks-per-job", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--checksum", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--durability", default="none", choices=("none", "file", "full"))
    p.add_argument("--shm", action="store_true", help="primary buffer in /dev/shm (as vLLM's)")
    p.add_argument("--poll-ms", type=float, default=0.5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    args.threads = args.threads or [1, 2, 4, 8, 16]
    args.numa = args.numa or ["off", "auto"]
    for d in args.dir:
        os.makedirs(d, exist_ok=True)
    info = machine(args.dir)
    print(
        f"# {info['node']}: {info['cpus']} CPUs ({info['cpu_model']}), {info['ram_gib']} GiB, "
        f"Linux {info['kernel']}, Python {info['python']}; NUMA nodes "
        f"{info['numa_nodes']}, allowed CPUs {info['allowed_cpus']}",
        flush=True,
    )
    block = int(args.block_mib * MiB)
    primary = Primary(args.blocks, block, args.shm)
    rows = []
    try:
        for medium in args.dir:
            for threads in args.threads:
                runs: dict[str, list[dict]] = {str(s): [] for s in args.numa}
                for round_no in range(args.rounds):
                    order = args.numa if round_no % 2 == 0 else args.numa[::-1]
                    for numa in order:
                        runs[str(numa)].append(
                            one_run(args, medium, primary, threads, numa, round_no)
                        )
                row = {"medium": medium, "threads": threads, "runs": runs}
                for s, rs in runs.items():
                    for d in ("store", "load"):
                        row[f"{d}_{s}"] = statistics.median(r[f"{d}_gbps"] for r in rs)
                    row[f"pinning_{s}"] = rs[0]["pinning"]
                row["o_direct"] = runs[str(args.numa[0])][0]["o_direct"]
                rows.append(row)
                print(
                    f"# {medium} threads={threads}: "
                    + ", ".join(f"{s} {row[f'store_{s}']:.2f}/{row[f'load_{s}']:.2f}" for s in runs)
                    + " GB/s store/load",
                    flush=True,
                )
    finally:
        primary.close()

    settings = [str(s) for s in args.numa]
    print(
        f"\n{args.blocks} blocks x {args.block_mib:g} MiB per direction, jobs of "
        f"{args.blocks_per_job}, median of {args.rounds}; checksum={args.checksum} "
        f"durability={args.durability}; threads = n_read = n_write; GB/s\n"
    )
    for medium in args.dir:
        mine = [r for r in rows if r["medium"] == medium]
        print(
            f"`{medium}`: {info['media'][medium]}, "
            f"{'O_DIRECT' if mine[0]['o_direct'] else 'buffered'}"
        )
        for s in settings:
            print(f"- numa_node={s}: {mine[0][f'pinning_{s}']}")
        print()
        print(
            "| threads | "
            + " | ".join(f"store {s}" for s in settings)
            + " | "
            + " | ".join(f"load {s}" for s in settings)
            + " |"
        )
        print("|---" * (1 + 2 * len(settings)) + "|")
        for r in mine:
            print(
                f"| {r['threads']} | "
                + " | ".join(f"{r[f'store_{s}']:.2f}" for s in settings)
                + " | "
                + " | ".join(f"{r[f'load_{s}']:.2f}" for s in settings)
                + " |"
            )
        print()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
