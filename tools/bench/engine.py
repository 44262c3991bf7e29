"""Engine-only scaling benchmark: FsEngine store/load GB/s against I/O
threads or worker processes (io_workers), with and without a scheduler
stand-in thread, NUMA-pinned against unpinned, beside vLLM's built-in fs
tier byte path (``--builtin``) and a compiled reference
(tools/bench/ref_blockio.c) doing our file format at the same concurrency. Imports
nothing from vLLM or torch (only llmkv_fs.engine, llmkv_fs.layout,
llmkv_fs.config and the stdlib; the built-in comes as a payload), so it runs
on any machine with Python 3.10+ and xxhash, e.g. a big box without vLLM:

    python3 -m tools.bench.engine --dir /mnt/nvme/bench --json out.json
    python3 -m tools.bench.engine --dir /dev/shm/b --mode threads --mode workers \
        --standin both --reference /tmp/ref_blockio --per-side 8
    python3 -m tools.bench.builtin_payload      # where vLLM 0.33 is installed
    python3 -m tools.bench.engine --dir /dev/shm/b --mode workers --io-workers auto \
        --builtin .bench_payload --builtin-threads 7,8,16 --case many --case long \
        --standin both --state both --numa auto --per-side 7 --blocks 2048 --rounds 5
    python3 -m tools.bench.engine --dir /mnt/r0 --dir /mnt/r1 --dir /mnt/r2 --dir /mnt/r3 \
        --root-sets 1,2,4 --mode workers --numa auto --per-side 7 --builtin .bench_payload

The primary buffer is a memfd mapping (or a /dev/shm file with --shm, like
vLLM's SharedOffloadRegion), so worker processes can map it. Each
configuration gets a fresh engine (or a fresh built-in thread pool) and an
empty directory; ``steady`` runs a warm-up pass (store and load of as many
other blocks) first, ``cold`` measures the first pass. It stores every block
of the case, then loads them back into the zeroed buffer and compares every
byte; rounds alternate the order of the configurations. ``per side`` k means
n_read_threads = n_write_threads = k for threads, io_workers = 2k for
processes unless ``--io-workers`` says otherwise. Cases: ``many`` is
``--blocks`` blocks in jobs of ``--blocks-per-job``; ``long`` is one job of
``--long-blocks`` blocks (one long prompt).

Several roots (issue 19): a ``--dir`` given as a comma list is one medium
of several roots, our engine placing blocks over them
(``path_sharding: by_block_hash``) and the built-in on the first root alone;
``--root-sets 1,2,4`` makes one medium of every root given and runs ours on
its first 1, 2 and 4 roots as configurations of the same rounds. Both report
the aggregate GB/s, ours / the built-in and ours / ours on one root.

Reported per run: GB/s; the owner thread's wall microseconds per block spent
inside submit_* and take_finished (what vLLM's scheduler pays); with the
stand-in (a thread in this process doing 0.5 ms of pure-Python work, then a
1 ms pause, like vLLM's busy engine-core thread) its iterations per second
relative to its rate with no engine running; for workers, their start-up
seconds and page-table kB (VmPTE) after the run. With ``--builtin``, the
ratio ours / built-in at its best thread count, per direction, case,
stand-in and state, from the same rounds.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.engine.workers.crew import resolve_io_workers
from llmkv_fs.harness.machine import machine_info
from llmkv_fs.layout.paths import CacheLayout
from tools.bench.engine_cli import io_workers_setting, parse_args
from tools.bench.engine_report import print_report, ratios, root_scaling
from tools.bench.support import (
    IDENTITY,
    MiB,
    Primary,
    StandIn,
    drive,
    make_keys,
    standin_idle_rate,
    worker_page_tables_kib,
)
from tools.bench.variants import applied

__all__ = ["IDENTITY", "drive", "make_keys"]

METRICS = (
    "store_gbps",
    "load_gbps",
    "store_owner_us",
    "load_owner_us",
    "store_standin",
    "load_standin",
    "startup_s",
    "worker_pte_kib",
)


def cases(args) -> list[dict]:
    """The cases asked for: name, blocks, blocks per job."""
    known = {
        "many": (args.blocks, args.blocks_per_job),
        "long": (args.long_blocks, args.long_blocks),
    }
    return [{"name": c, "blocks": known[c][0], "per_job": known[c][1]} for c in args.case]


def open_tier(
    args, roots: list[str], primary: Primary, config: dict, per_side: int
) -> tuple[Any, float]:
    """A fresh FsEngine for our configurations (sharded over ``roots`` when
    there are several), a fresh built-in tier on the first root for
    ``builtin`` ones; and the seconds it took to start."""
    block = int(args.block_mib * MiB)
    if config["mode"] == "builtin":
        from tools.bench.builtin import BuiltinTier

        builtin = BuiltinTier(args.payload, roots[0], primary.mm, block, config["threads"])
        return builtin, builtin.startup_s
    workers: str | int = 0
    variant = config["variant"]
    if config["mode"] == "workers":
        workers = args.io_workers if args.io_workers is not None else 2 * per_side
        if "io_workers" in variant:
            workers = io_workers_setting(variant["io_workers"])
    settings = TierSettings.from_mapping(
        {
            "root_dir": ",".join(roots),
            "path_sharding": "by_block_hash" if len(roots) > 1 else "none",
            "n_read_threads": per_side,
            "n_write_threads": per_side,
            "io_workers": workers,
            "numa_node": config["numa"],
            "checksum": args.checksum,
            "durability": args.durability,
            "max_pending_store_bytes": max(2 << 30, primary.size),
            "io_workers_nice": int(variant.get("nice", 0)),
            "compiled_io": variant.get("compiled", "on") != "off",
            **({"seal_key_files": {"1": variant["seal"]}} if "seal" in variant else {}),
        }
    )
    layouts = [CacheLayout.for_identity(r, IDENTITY) for r in settings.root_dirs]
    t = time.perf_counter()
    with applied(variant):
        engine = FsEngine(settings, layouts, primary.mm, block)
    startup_s = time.perf_counter() - t
    if engine.io_workers != resolve_io_workers(workers):
        engine.shutdown()
        raise RuntimeError(f"asked for {workers} workers, engine runs {engine.io_workers}")
    return engine, startup_s


def one_run(args, medium, primary, config, per_side, case, round_no) -> dict:
    block, n, per_job = int(args.block_mib * MiB), case["blocks"], case["per_job"]
    used = medium[: config.get("roots") or len(medium)]
    roots = [os.path.join(d, f"llmkv-bench-engine-{os.getpid()}") for d in used]
    for root in roots:
        os.makedirs(root, exist_ok=True)
    tier, startup_s = open_tier(args, roots, primary, config, per_side)
    standin = None
    try:
        poll = args.poll_ms / 1000
        seed = f"{config['label']}-{case['name']}-{per_side}-{round_no}"
        if config["steady"]:  # a long-running server: workers and directories warm
            warm = make_keys(n, "warm-" + seed)
            drive(tier, warm, per_job, False, poll, 2 << 20)
            drive(tier, warm, per_job, True, poll, 3 << 20)
        keys = make_keys(n, seed)
        standin = StandIn() if config["standin"] else None
        if standin:
            standin.mark()
        store_s, store_owner = drive(tier, keys, per_job, False, poll, 0)
        store_rate = standin.rate() if standin else 0.0
        primary.zero(n)
        if standin:
            standin.mark()
        load_s, load_owner = drive(tier, keys, per_job, True, poll, 1 << 20)
        load_rate = standin.rate() if standin else 0.0
        primary.verify(n)
        return {
            "store_gbps": n * block / store_s / 1e9,
            "load_gbps": n * block / load_s / 1e9,
            "store_owner_us": store_owner / n * 1e6,
            "load_owner_us": load_owner / n * 1e6,
            "store_standin": store_rate,
            "load_standin": load_rate,
            "startup_s": startup_s,
            "worker_pte_kib": worker_page_tables_kib(tier),
            "pinning": getattr(getattr(tier, "pinning", None), "reason", "-"),
            "o_direct": tier.roots[0].use_o_direct if hasattr(tier, "roots") else tier.use_o_direct,
            "root_store_blocks": root_store_blocks(tier, len(roots)),
        }
    finally:
        if standin:
            standin.stop()
        tier.shutdown()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def root_store_blocks(tier: Any, n_roots: int) -> list[int]:
    """Blocks stored on each root (placement's balance); the built-in: all on one."""
    counts = getattr(tier, "root_counters", None)
    if counts is None:
        return []
    return [
        sum(v for (i, d, ok), v in counts.items() if i == k and ok and d.value == "store")
        for k in range(n_roots)
    ]


def reference_run(args, medium: tuple[str, ...], per_side: int, blocks: int) -> dict:
    """The compiled reference at 2 x per_side pthreads (as many as serve a
    one-direction burst in our engine), on the medium's first root."""
    root = os.path.join(medium[0], f"llmkv-bench-ref-{os.getpid()}")
    try:
        out = subprocess.run(
            [
                args.reference,
                root,
                str(int(args.block_mib * MiB)),
                str(blocks),
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
    states = {"cold": [False], "steady": [True], "both": [False, True]}[args.state]
    out = []
    for steady in states:
        for standin in standins:
            tail = ("/standin" if standin else "") + ("/steady" if steady else "")
            common = {"standin": standin, "steady": steady}
            for mode in args.mode:
                for numa in args.numa:
                    for variant in args.ours:
                        named = f"[{variant.name}]" if len(args.ours) > 1 else ""
                        base = f"{mode}{named}/numa={numa}{tail}"
                        config = {"mode": mode, "numa": numa, "variant": variant, "base": base}
                        for k in args.root_sets or [None]:
                            label = base + (f"/roots={k}" if k else "")
                            out.append({**config, "roots": k, "label": label, **common})
            for k in args.builtin_threads:
                label = f"builtin/{k}+{k}{tail}"
                out.append({"mode": "builtin", "threads": k, "label": label, **common})
    return out


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0])
    all_roots = list(dict.fromkeys(r for medium in args.media for r in medium))
    for d in all_roots:
        os.makedirs(d, exist_ok=True)
    args.payload = None
    if args.builtin:  # first: machine_info imports an installed vLLM, if any
        from tools.bench.builtin import load_payload

        args.payload = load_payload(args.builtin)
    info = machine_info(all_roots)
    if args.payload is not None:
        info["builtin_payload"] = args.payload.manifest
    print(
        f"# {info['node']}: {info['cpus']} CPUs ({info['cpu_model']}), {info['ram_gib']} GiB, "
        f"Linux {info['kernel']}, Python {info['python']}; NUMA nodes "
        f"{info['numa_cpus']}, allowed CPUs {info['allowed_cpulist']}; load {os.getloadavg()}"
        + (f"; vLLM {info['builtin_payload']['vllm_version']} payload" if args.builtin else ""),
        flush=True,
    )
    configs = configurations(args)
    idle_rate = standin_idle_rate() if args.standin != "off" else 0.0
    info["standin_idle_per_s"] = idle_rate
    block = int(args.block_mib * MiB)
    primary = Primary(max(c["blocks"] for c in cases(args)), block, args.shm)
    rows = []
    try:
        for medium in args.media:
            for case in cases(args):
                for per_side in args.per_side:
                    row = measure(args, medium, primary, configs, per_side, case, idle_rate)
                    rows.append(row)
                    save(args, info, rows)  # so far: a run cut short keeps its rows
    finally:
        primary.close()
    info["load_average_after"] = os.getloadavg()
    root_scaling(configs, rows)
    save(args, info, rows)
    print_report(args, rows, idle_rate)
    return 0


def save(args, info: dict, rows: list[dict]) -> None:
    if args.json:
        saved = {k: v for k, v in vars(args).items() if k != "payload"}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "args": saved, "rows": rows}, f, indent=2)


def measure(args, medium, primary, configs, per_side, case, idle_rate) -> dict:
    """Rounds of every configuration, alternating their order; the row."""
    runs: dict[str, list[dict]] = {c["label"]: [] for c in configs}
    refs = []
    for round_no in range(args.rounds):
        order = configs if round_no % 2 == 0 else configs[::-1]
        for config in order:
            runs[config["label"]].append(
                one_run(args, medium, primary, config, per_side, case, round_no)
            )
        if args.reference and case["name"] == "many":
            refs.append(reference_run(args, medium, per_side, case["blocks"]))
    row = summarize(",".join(medium), per_side, configs, runs, refs, idle_rate)
    row["case"] = case
    row["roots"] = list(medium)
    print(f"# {row['medium']} {case['name']} per side={per_side}: " + line_of(row), flush=True)
    return row


def summarize(medium, per_side, configs, runs, refs, idle_rate) -> dict:
    medians = {}
    for label, rs in runs.items():
        m = {k: statistics.median(r[k] for r in rs) for k in METRICS}
        for d in ("store", "load"):
            m[f"{d}_standin_ratio"] = m[f"{d}_standin"] / idle_rate if idle_rate else 0.0
        m["pinning"] = rs[0]["pinning"]
        m["o_direct"] = rs[0]["o_direct"]
        m["root_store_blocks"] = rs[0]["root_store_blocks"]
        medians[label] = m
    reference = (
        {d: statistics.median(r[d] for r in refs) for d in ("store_gbps", "load_gbps")}
        if refs
        else None
    )
    return {
        "medium": medium,
        "per_side": per_side,
        "configs": medians,
        "ratios": ratios(configs, medians),
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
