"""tools/profile_block.py's ``engine`` part: the real engine (FsEngine,
io_workers auto) storing and loading ``--engine-blocks`` blocks in jobs of 8,
a cold pass (fresh workers) then a steady one (same engine, new keys), with
per block, from /proc:

* workers: CPU µs (``schedstat``: time on a CPU, ns), run-queue wait µs
  (ready but no CPU free), off-CPU µs (asleep: waiting for work, or blocked
  on a lock), user and system share, minor page faults, voluntary and
  involuntary context switches -- summed over the workers, per block;
* the conductor thread's CPU µs, and this (the owner's) whole process's
  (with threads, the I/O threads are the "workers" and in it too).

Variants (``--variants``): ``workers`` as shipped; ``populate``: each
worker maps the region and then ``madvise(MADV_POPULATE_WRITE)`` over all of
it (page-table entries made once at start, no first-touch faults), done
from a ``sitecustomize`` this tool puts on the workers' PYTHONPATH --
the engine is not changed; ``nochecksum``: checksum off; ``threads``: I/O
threads in this process (7 per side), no region handover.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

from bench_support import IDENTITY, Primary, drive, make_keys

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.layout.paths import CacheLayout

__all__ = ["engine_profiles"]

SITECUSTOMIZE = """
import os
if os.environ.get("LLMKV_PROFILE_POPULATE"):
    import ctypes
    from llmkv_fs.engine.workers import region as _region
    _map_region = _region.map_region
    def map_region(size, segments, fds):
        view = _map_region(size, segments, fds)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = ctypes.addressof(ctypes.c_char.from_buffer(view))
        if libc.madvise(start, view.nbytes, 23):  # MADV_POPULATE_WRITE
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
        return view
    _region.map_region = map_region
"""
TICK = os.sysconf("SC_CLK_TCK")


def proc_sample(path: str) -> dict[str, float]:
    """CPU ns, run-queue ns, user/system s, minor faults, context switches
    of /proc/<pid> or /proc/self/task/<tid>."""
    with open(f"{path}/schedstat", encoding="ascii") as f:
        on_cpu, waiting, _slices = (int(x) for x in f.read().split())
    with open(f"{path}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    out = {
        "cpu_ns": on_cpu,
        "runq_ns": waiting,
        "minflt": int(fields[7]),
        "user_s": int(fields[11]) / TICK,
        "sys_s": int(fields[12]) / TICK,
    }
    with open(f"{path}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                name, value = line.split(":")
                out[name] = int(value)
    return out


def snapshot(engine: FsEngine) -> dict[str, dict]:
    """Samples of the workers (the I/O threads of this process when the
    engine runs threads), the conductor thread, and this whole process."""
    main_tid = threading.main_thread().native_id
    tasks = {int(t): f"/proc/self/task/{t}" for t in os.listdir("/proc/self/task")}
    conductor = getattr(engine.executor, "_conductor", None)
    conductor_tid = conductor.native_id if conductor is not None else None
    pids = engine.executor.worker_pids()
    if pids:
        workers = {pid: f"/proc/{pid}" for pid in pids}
    else:
        workers = {t: p for t, p in tasks.items() if t not in (main_tid, conductor_tid)}
    samples = {name: proc_sample(path) for name, path in workers.items()}
    every = [proc_sample(path) for path in tasks.values()]
    return {
        "workers": samples,
        "conductor": {0: proc_sample(tasks[conductor_tid])} if conductor_tid in tasks else {},
        "process": {0: {k: sum(s.get(k, 0) for s in every) for k in every[0]}},
    }


def _total(before: dict, after: dict, group: str, key: str) -> float:
    a, b = after[group], before[group]
    return sum(a[name][key] - b[name][key] for name in a if name in b)


def per_block(before: dict, after: dict, n: int, wall_s: float) -> dict[str, float]:
    def total(key: str, group: str = "workers") -> float:
        return _total(before, after, group, key)

    workers = sum(1 for name in after["workers"] if name in before["workers"])
    cpu_ns, runq_ns = total("cpu_ns"), total("runq_ns")
    user_s, sys_s = total("user_s"), total("sys_s")
    out = {
        "gbps": 0.0,
        "workers": workers,
        "worker_cpu_us": cpu_ns / n / 1e3,
        "worker_runq_us": runq_ns / n / 1e3,
        "worker_offcpu_us": (workers * wall_s * 1e9 - cpu_ns - runq_ns) / n / 1e3,
        "worker_sys_share": sys_s / max(1e-9, sys_s + user_s),
        "worker_minflt": total("minflt") / n,
        "worker_vol_cs": total("voluntary_ctxt_switches") / n,
        "worker_invol_cs": total("nonvoluntary_ctxt_switches") / n,
        "process_cpu_us": total("cpu_ns", "process") / n / 1e3,
        "process_minflt": total("minflt", "process") / n,
    }
    if after["conductor"] and before["conductor"]:
        out["conductor_cpu_us"] = total("cpu_ns", "conductor") / n / 1e3
    return out


def open_engine(
    root: str, primary: Primary, block: int, variant: str, io_workers: str | int
) -> FsEngine:
    settings = TierSettings.from_mapping(
        {
            "root_dir": root,
            "n_read_threads": 7,
            "n_write_threads": 7,
            "io_workers": 0 if variant == "threads" else io_workers,
            "numa_node": "auto",
            "checksum": "nochecksum" not in variant,
            "durability": "none",
            "max_pending_store_blocks": max(1024, primary.size // block),
        }
    )
    return FsEngine(settings, CacheLayout.for_identity(root, IDENTITY), primary.mm, block)


def one_variant(args, where: str, primary: Primary, block: int, variant: str) -> dict:
    n = args.engine_blocks
    root = os.path.join(where, f"engine-{variant}")
    os.makedirs(root)
    t = time.perf_counter()
    workers = args.io_workers if args.io_workers == "auto" else int(args.io_workers)
    engine = open_engine(root, primary, block, variant, workers)
    out: dict = {"startup_s": time.perf_counter() - t, "io_workers": engine.io_workers}
    try:
        for state in ("cold", "steady"):
            keys = make_keys(n, f"{variant}-{state}")
            for load in (False, True):
                if load:
                    primary.zero(n)
                before = snapshot(engine)
                wall, _owner = drive(engine, keys, 8, load, 0.0005, (2 if load else 0) << 20)
                row = per_block(before, snapshot(engine), n, wall)
                row["gbps"] = n * block / wall / 1e9
                out[f"{state} {'load' if load else 'store'}"] = row
            primary.verify(n)
        out["worker_pte_kib"] = max([vm_pte(pid) for pid in engine.executor.worker_pids()] or [0])
    finally:
        engine.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return out


def vm_pte(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next((int(x.split()[1]) for x in f if x.startswith("VmPTE:")), 0)


def engine_profiles(args, where: str, block: int) -> dict:
    n = args.engine_blocks
    primary = Primary(n, block, False)
    site = tempfile.mkdtemp(prefix="llmkv_profile_site_")
    with open(os.path.join(site, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(SITECUSTOMIZE)
    saved = dict(os.environ)
    results = {}
    try:
        for variant in args.variants.split(","):
            os.environ.clear()
            os.environ.update(saved)
            if variant.startswith("populate"):
                os.environ["LLMKV_PROFILE_POPULATE"] = "1"
                os.environ["PYTHONPATH"] = os.pathsep.join(
                    p for p in (site, saved.get("PYTHONPATH")) if p
                )
            name = variant if variant not in results else f"{variant}#{len(results) + 1}"
            results[name] = one_variant(args, where, primary, block, variant)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        primary.close()
        shutil.rmtree(site, ignore_errors=True)
    print_engine(results, n, block)
    return results


COLUMNS = (
    ("gbps", "GB/s", "{:.2f}"),
    ("worker_cpu_us", "worker CPU", "{:.0f}"),
    ("worker_runq_us", "run-queue", "{:.0f}"),
    ("worker_offcpu_us", "off-CPU", "{:.0f}"),
    ("worker_sys_share", "sys share", "{:.2f}"),
    ("worker_minflt", "faults", "{:.0f}"),
    ("worker_vol_cs", "vol cs", "{:.1f}"),
    ("worker_invol_cs", "invol cs", "{:.1f}"),
    ("conductor_cpu_us", "conductor CPU", "{:.1f}"),
    ("process_cpu_us", "this process CPU", "{:.1f}"),
)


def print_engine(results: dict, n: int, block: int) -> None:
    print(
        f"\n## the engine, {n} blocks of {block >> 10} KiB in jobs of 8: per block "
        "(µs, summed over workers; faults and context switches per block)\n"
    )
    print("| variant | pass | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for variant, r in results.items():
        for name, row in r.items():
            if not isinstance(row, dict):
                continue
            cells = [fmt.format(row[key]) if key in row else "-" for key, _, fmt in COLUMNS]
            print(f"| {variant} | {name} | " + " | ".join(cells) + " |")
        print(
            f"| {variant} | start-up {r['startup_s']:.2f} s, {r['io_workers']} workers, "
            f"VmPTE {r['worker_pte_kib']} kB |" + " |" * len(COLUMNS)
        )
    sys.stdout.flush()
