"""Soak the tier through vLLM's real scheduler-side manager: a million small
jobs (stores, loads, lookups; every load checked byte for byte) per engine
mode, with RSS, open fds and threads at start and end.

    python3 -m tools.soak.run                  # ours: io_workers 0 and 2, 1,000,000 jobs each
    python3 -m tools.soak.run --jobs 200000 --io-workers 2
    python3 -m tools.soak.run --builtin        # vLLM's built-in fs tier, same driver

(from the repository's root).

Each run is a fresh process (so one run's memory is not the next one's
baseline) on a fresh directory under ``--root`` (default /dev/shm: tmpfs,
where the built-in's abort was measured). Exits non-zero when a run served
a wrong byte, answered HIT for a key never stored, grew (fds, threads,
worker processes; RSS beyond the bound in tools/soak/probe.py)
or died. The workload is tools/soak/workload.py; results in
docs/benchmarks.md ("Soak").

``--builtin`` soaks vLLM 0.33.0's built-in fs tier instead. Its C extension
returns None without a reference, so every job lowers None's reference
count by one (the progress lines show it); on Python 3.10/3.11 the process
aborts with ``Fatal Python error: none_dealloc`` once it reaches zero. The
child's exit status and the end of its stderr are reported.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

RESULT_TAG = "SOAK-RESULT "
MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000, help="tier jobs per run")
    parser.add_argument(
        "--io-workers", type=int, nargs="+", default=[0, 2], help="engine modes to soak"
    )
    parser.add_argument("--threads", type=int, default=2, help="read and write I/O threads each")
    parser.add_argument("--root", default="/dev/shm", help="where each run's directory goes")
    parser.add_argument("--builtin", action="store_true", help="soak vLLM's built-in fs tier")
    parser.add_argument("--json", metavar="FILE", help="write every run's report here")
    parser.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- one run, in its own process ---------------------------------------------------


def child(spec: dict) -> int:
    from llmkv_fs.harness import driver
    from tools.soak.workload import SoakPlan, SoakStuck, run_soak

    threads = {"n_read_threads": spec["threads"], "n_write_threads": spec["threads"]}
    if spec["tier"] == "builtin":
        tier = driver.builtin(spec["root"], **threads)
    else:
        tier = driver.ours(spec["root"], io_workers=spec["io_workers"], **threads)

    def progress(line: str) -> None:
        print(f"[{spec['label']}] {line}", file=sys.stderr, flush=True)

    try:
        plan = SoakPlan(jobs=spec["jobs"], progress=progress)
        report = run_soak(tier, plan, engine_id=spec["engine_id"])
    except SoakStuck as stuck:
        progress(f"STUCK: {stuck}")
        return 2
    print(RESULT_TAG + json.dumps(report.as_dict()), flush=True)
    return 1 if report.problems else 0


def run_child(spec: dict) -> dict:
    """Run one soak in a fresh interpreter; its stderr is echoed as it comes
    and its last lines kept (the built-in's fatal error is there)."""
    started = time.monotonic()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.soak.run", "--child", json.dumps(spec)],
        cwd=repo,  # -m finds tools/ (and this checkout's llmkv_fs) from here
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tail: collections.deque[str] = collections.deque(maxlen=30)
    last_progress = fatal = ""
    assert proc.stderr is not None and proc.stdout is not None
    for line in proc.stderr:
        tail.append(line.rstrip("\n"))
        if line.startswith(f"[{spec['label']}]"):
            last_progress = tail[-1]
        if "Fatal Python error" in line:
            fatal = tail[-1]
        if line.startswith(f"[{spec['label']}]") or "Fatal Python error" in line:
            print(line, end="", file=sys.stderr, flush=True)
    out = proc.stdout.read()
    status = proc.wait()
    results = [
        json.loads(line[len(RESULT_TAG) :])
        for line in out.splitlines()
        if line.startswith(RESULT_TAG)
    ]
    return {
        "label": spec["label"],
        "exit_status": status,
        "seconds": round(time.monotonic() - started, 1),
        "report": results[0] if results else None,
        "last_progress": last_progress,
        "fatal_error": fatal,
        "stderr_tail": list(tail),
    }


# -- the parent: every run, then a summary ----------------------------------------


def describe(run: dict) -> list[str]:
    status = run["exit_status"]
    how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
    lines = [f"{run['label']}: {how} after {run['seconds']} s"]
    report = run["report"]
    if report is None:
        lines.append(f"  last progress: {run['last_progress'] or 'none'}")
        fatal = [run["fatal_error"]] if run["fatal_error"] else run["stderr_tail"][-5:]
        lines += [f"  {line}" for line in fatal]
        return lines
    tally = report["tally"]
    lines.append(
        f"  {tally['store_jobs'] + tally['load_jobs']:,} jobs ({tally['store_jobs']:,} stores, "
        f"{tally['load_jobs']:,} loads), {tally['lookups']:,} lookups, "
        f"{tally['blocks_checked']:,} blocks checked: {report['jobs_per_s']:,} jobs/s"
    )
    lines.append(
        f"  wrong blocks {tally['wrong_blocks']}, phantom hits {tally['phantom_hits']}, "
        f"failed jobs {tally['failed_store_jobs'] + tally['failed_load_jobs']}, "
        f"lost keys {tally['lost_keys']}"
    )
    for name in ("start", "warm", "end"):
        snap = report[name]
        lines.append(
            f"  {name:5} at {snap['jobs']:>9,} jobs: RSS {snap['rss'] / MiB:7.1f} MiB, "
            f"{snap['fds']} fds, {snap['threads']} threads, {snap['children']} children "
            f"(RSS {snap['children_rss'] / MiB:.1f} MiB, {snap['children_fds']} fds), "
            f"None refs {snap['none_refs']:,}"
        )
    lines += [f"  PROBLEM: {problem}" for problem in report["problems"]] or [
        "  no growth, no wrong byte"
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    modes = [("builtin", 0)] if args.builtin else [("ours", n) for n in args.io_workers]
    print(
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    runs = []
    for tier, io_workers in modes:
        label = "builtin" if tier == "builtin" else f"io_workers={io_workers}"
        root = tempfile.mkdtemp(prefix="llmkv_soak_", dir=args.root)
        engine_id = f"llmkvsoak_{uuid.uuid4().hex[:12]}"
        spec = {"tier": tier, "io_workers": io_workers, "jobs": args.jobs}
        spec |= {"threads": args.threads, "root": root, "label": label, "engine_id": engine_id}
        try:
            runs.append(run_child(spec))
        finally:
            shutil.rmtree(root, ignore_errors=True)
            # A child that aborted (the built-in) never unmapped its CPU tier.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/vllm_offload_{engine_id}.mmap")
        runs[-1]["load_average_after"] = round(os.getloadavg()[0], 2)
        print(
            "\n".join(describe(runs[-1])),
            f"  load average {runs[-1]['load_average_after']}",
            sep="\n",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0 if all(run["exit_status"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
