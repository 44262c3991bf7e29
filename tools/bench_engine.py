"""Engine-only scaling benchmark: FsEngine store/load GB/s against I/O
threads or worker processes (io_workers), with and without a scheduler
stand-in thread, NUMA-pinned against unpinned, and a compiled reference
(tools/ref_blockio.c) doing our file format at the same concurrency. Imports
nothing from vLLM or torch (only llmkv_fs.engine, llmkv_fs.layout,
llmkv_fs.config and the stdlib), so it runs on any machine with Python 3.10+
and xxhash, e.g. a big box without vLLM:

    python3 tools/bench_engine.py --dir /mnt/nvme/bench --json out.json
    python3 tools/bench_engine.py --dir /dev/shm/b --mode threads --mode workers \
        --standin both --reference /tmp/ref_blockio --per-side 8

The primary buffer is a memfd mapping (or a /dev/shm file with --shm, like
vLLM's SharedOffloadRegion), so worker processes can map it. Each
configuration gets a fresh engine and an empty directory, stores every
block, then loads them back into the zeroed buffer and compares bytes;
rounds alternate the order of the configurations. ``per side`` k means
n_read_threads = n_write_threads = k for threads, io_workers = 2k for
processes (2k threads or processes serve a one-direction burst either way).

Reported per run: GB/s; the owner thread's wall microseconds per block spent
inside submit_* and take_finished (what vLLM's scheduler pays); with the
stand-in (a thread in this process doing 0.5 ms of pure-Python work, then a
1 ms pause, like vLLM's busy engine-core thread) its iterations per second
relative to its rate with no engine running; for workers, their start-up
seconds and page-table kB (VmPTE) after the run.
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
import subprocess
import sys
import threading
import time

if importlib.util.find_spec("llmkv_fs") is None:  # a checkout, not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.engine.volume.numa import format_cpulist, read_topology
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
    """The CPU tier stand-in: nblocks rows of block bytes, page aligned, in
    shared memory a worker process can map (a memfd, or a /dev/shm file)."""

    def __init__(self, nblocks: int, block: int, shm: bool):
        self.size, self.path = nblocks * block, None
        if shm:
            self.path = f"/dev/shm/llmkv_bench_engine_{os.getpid()}.mmap"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        else:
            fd = os.memfd_create("llmkv_bench_primary", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.size)
            self.mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
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


class StandIn:
    """vLLM's engine-core thread, roughly: 0.5 ms of pure-Python work, a 1 ms
    pause, forever. ``rate()`` is iterations per second since ``mark()``."""

    BUSY_S, PAUSE_S = 0.0005, 0.001

    def __init__(self):
        self.iterations = 0
        self._stop = threading.Event()
        self._mark = (time.perf_counter(), 0)
        self._thread = threading.Thread(target=self._run, daemon=True, name="standin")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            end = time.perf_counter() + self.BUSY_S
            x = 0
            while time.perf_counter() < end:
                for i in range(50):
                    x += i * i
            self.iterations += 1
            time.sleep(self.PAUSE_S)

    def mark(self) -> None:
        self._mark = (time.perf_counter(), self.iterations)

    def rate(self) -> float:
        t0, n0 = self._mark
        return (self.iterations - n0) / max(1e-9, time.perf_counter() - t0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def standin_idle_rate(seconds: float = 2.0) -> float:
    standin = StandIn()
    time.sleep(0.2)
    standin.mark()
    time.sleep(seconds)
    rate = standin.rate()
    standin.stop()
    return rate


def drive(
    engine: FsEngine, keys: list[bytes], per_job: int, load: bool, poll_s: float, first_id: int
) -> tuple[float, float]:
    """Submit every block as jobs of ``per_job``; poll until all finish.
    Returns (seconds, owner seconds spent inside submit_* and take_finished)."""
    pending = set()
    clock = time.perf_counter
    started = clock()
    owner = 0.0
    for job_id, lo in enumerate(range(0, len(keys), per_job), start=first_id):
        chunk_ids = list(range(lo, min(lo + per_job, len(keys))))
        t = clock()
        if load:
            ok = engine.submit_load(job_id, keys[lo : lo + per_job], chunk_ids)
        else:
            ok = engine.submit_store(job_id, keys[lo : lo + per_job], chunk_ids)
        owner += clock() - t
        if not ok:
            raise RuntimeError("job refused: raise --blocks or max_pending_store_blocks")
        pending.add(job_id)
    while pending:
        t = clock()
        finished = engine.take_finished()
        owner += clock() - t
        for job in finished:
            if job.failed:
                raise RuntimeError(
                    f"{'load' if load else 'store'} job {job.job_id}: "
                    f"{len(job.failed)} blocks failed ({dict(engine.counters)})"
                )
            pending.discard(job.job_id)
        if pending:
            time.sleep(poll_s)
    return clock() - started, owner


def worker_page_tables_kib(engine: FsEngine) -> int:
    """Largest VmPTE among the engine's worker processes (0 for threads)."""
    most = 0
    for pid in getattr(engine.executor, "worker_pids", lambda: [])():
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmPTE:"):
                        most = max(most, int(line.split()[1]))
        except OSError:
            pass
    return most


def one_run(args, medium: str, primary: Primary, config: dict, per_side: int, round_no: int):
    block, n = int(args.block_mib * MiB), args.blocks
    root = os.path.join(medium, f"llmkv-bench-engine-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    layout = CacheLayout.for_identity(root, IDENTITY)
    workers = 2 * per_side if config["mode"] == "workers" else 0
    settings = TierSettings.from_mapping(
        {
            "root_dir": root,
            "n_read_threads": per_side,
            "n_write_threads": per_side,
            "io_workers": workers,
            "numa_node": config["numa"],
            "checksum": args.checksum,
            "durability": args.durability,
            "max_pending_store_blocks": max(1024, n),
        }
    )
    t = time.perf_counter()
    engine = FsEngine(settings, layout, primary.mm, block)
    startup_s = time.perf_counter() - t
    if engine.io_workers != workers:
        raise RuntimeError(f"asked for {workers} workers, engine runs {engine.io_workers}")
    standin = StandIn() if config["standin"] else None
    try:
        keys = make_keys(n, f"{config['label']}-{per_side}-{round_no}")
        poll = args.poll_ms / 1000
        if standin:
            standin.mark()
        store_s, store_owner = drive(engine, keys, args.blocks_per_job, False, poll, 0)
        store_rate = standin.rate() if standin else 0.0
        primary.zero()
        if standin:
            standin.mark()
        load_s, load_owner = drive(engine, keys, args.blocks_per_job, True, poll, 1 << 20)
        load_rate = standin.rate() if standin else 0.0
        if primary.mm[:] != primary.expected:
            raise RuntimeError("loaded bytes differ from stored bytes")
        return {
            "store_gbps": n * block / store_s / 1e9,
            "load_gbps": n * block / load_s / 1e9,
            "store_owner_us": store_owner / n * 1e6,
            "load_owner_us": load_owner / n * 1e6,
            "store_standin": store_rate,
            "load_standin": load_rate,
            "startup_s": startup_s,
            "worker_pte_kib": worker_page_tables_kib(engine),
            "pinning": engine.pinning.reason,
            "o_direct": engine.use_o_direct,
        }
    finally:
        if standin:
            standin.stop()
        engine.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def reference_run(args, medium: str, per_side: int) -> dict:
    """The compiled reference at 2 x per_side pthreads (as many as serve a
    one-direction burst in our engine)."""
    root = os.path.join(medium, f"llmkv-bench-ref-{os.getpid()}")
    try:
        out = subprocess.run(
            [
                args.reference,
                root,
                str(int(args.block_mib * MiB)),
                str(args.blocks),
                str(2 * per_side),
                "1" if args.checksum else "0",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return json.loads(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def configurations(args) -> list[dict]:
    standins = {"off": [False], "on": [True], "both": [False, True]}[args.standin]
    out = []
    for mode in args.mode:
        for numa in args.numa:
            for standin in standins:
                label = f"{mode}/numa={numa}{'/standin' if standin else ''}"
                out.append({"mode": mode, "numa": numa, "standin": standin, "label": label})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", action="append", required=True, help="medium (repeat)")
    p.add_argument(
        "--per-side",
        "--threads",
        dest="per_side",
        action="append",
        type=int,
        help="sweep: threads per side, or io_workers / 2 (default 1 2 4 8 16)",
    )
    p.add_argument(
        "--mode",
        action="append",
        choices=("threads", "workers"),
        help="threads (io_workers=0) and/or workers (repeat; default threads)",
    )
    p.add_argument(
        "--standin",
        choices=("off", "on", "both"),
        default="off",
        help="run the scheduler stand-in thread during the runs",
    )
    p.add_argument(
        "--numa",
        action="append",
        type=numa_setting,
        help='numa_node settings to compare (repeat; default "off" and "auto")',
    )
    p.add_argument("--reference", metavar="BINARY", help="compiled tools/ref_blockio.c")
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
    args.per_side = args.per_side or [1, 2, 4, 8, 16]
    args.numa = args.numa or ["off", "auto"]
    args.mode = args.mode or ["threads"]
    for d in args.dir:
        os.makedirs(d, exist_ok=True)
    info = machine(args.dir)
    print(
        f"# {info['node']}: {info['cpus']} CPUs ({info['cpu_model']}), {info['ram_gib']} GiB, "
        f"Linux {info['kernel']}, Python {info['python']}; NUMA nodes "
        f"{info['numa_nodes']}, allowed CPUs {info['allowed_cpus']}; load {os.getloadavg()}",
        flush=True,
    )
    configs = configurations(args)
    idle_rate = standin_idle_rate() if args.standin != "off" else 0.0
    info["standin_idle_per_s"] = idle_rate
    block = int(args.block_mib * MiB)
    primary = Primary(args.blocks, block, args.shm)
    rows = []
    try:
        for medium in args.dir:
            for per_side in args.per_side:
                runs: dict[str, list[dict]] = {c["label"]: [] for c in configs}
                refs = []
                for round_no in range(args.rounds):
                    order = configs if round_no % 2 == 0 else configs[::-1]
                    for config in order:
                        runs[config["label"]].append(
                            one_run(args, medium, primary, config, per_side, round_no)
                        )
                    if args.reference:
                        refs.append(reference_run(args, medium, per_side))
                row = summarize(medium, per_side, runs, refs, idle_rate)
                rows.append(row)
                print(f"# {medium} per side={per_side}: " + line_of(row), flush=True)
    finally:
        primary.close()
    print(
        f"\n{args.blocks} blocks x {args.block_mib:g} MiB per direction, jobs of "
        f"{args.blocks_per_job}, median of {args.rounds}; checksum={args.checksum} "
        f"durability={args.durability}; stand-in idle rate {idle_rate:.0f}/s\n"
    )
    print(
        "| medium | per side | configuration | store GB/s | load GB/s | owner us/block "
        "store/load | stand-in store/load vs idle | PTE kB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for label, m in r["configs"].items():
            print(
                f"| {r['medium']} | {r['per_side']} | {label} | {m['store_gbps']:.2f} | "
                f"{m['load_gbps']:.2f} | {m['store_owner_us']:.1f} / {m['load_owner_us']:.1f} | "
                + (
                    f"{m['store_standin_ratio']:.2f} / {m['load_standin_ratio']:.2f}"
                    if m["store_standin_ratio"]
                    else "-"
                )
                + f" | {m['worker_pte_kib']} |"
            )
        if r["reference"]:
            ref = r["reference"]
            print(
                f"| {r['medium']} | {r['per_side']} | C reference | {ref['store_gbps']:.2f} | "
                f"{ref['load_gbps']:.2f} | - | - | - |"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=2)
    return 0


def summarize(medium: str, per_side: int, runs: dict, refs: list, idle_rate: float) -> dict:
    configs = {}
    for label, rs in runs.items():
        m = {
            k: statistics.median(r[k] for r in rs)
            for k in (
                "store_gbps",
                "load_gbps",
                "store_owner_us",
                "load_owner_us",
                "store_standin",
                "load_standin",
                "startup_s",
                "worker_pte_kib",
            )
        }
        for d in ("store", "load"):
            m[f"{d}_standin_ratio"] = m[f"{d}_standin"] / idle_rate if idle_rate else 0.0
        m["pinning"] = rs[0]["pinning"]
        m["o_direct"] = rs[0]["o_direct"]
        configs[label] = m
    reference = (
        {d: statistics.median(r[d] for r in refs) for d in ("store_gbps", "load_gbps")}
        if refs
        else None
    )
    return {
        "medium": medium,
        "per_side": per_side,
        "configs": configs,
        "reference": reference,
        "runs": runs,
        "reference_runs": refs,
    }


def line_of(row: dict) -> str:
    parts = [
        f"{label} {m['store_gbps']:.2f}/{m['load_gbps']:.2f}" for label, m in row["configs"].items()
    ]
    if row["reference"]:
        parts.append(f"C {row['reference']['store_gbps']:.2f}/{row['reference']['load_gbps']:.2f}")
    return ", ".join(parts) + " GB/s store/load"


if __name__ == "__main__":
    sys.exit(main())
