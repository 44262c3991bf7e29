"""The latency matrix (issue 26): our tier against vLLM's built-in fs tier
on a real network filesystem with latency added on the server side, both on
the same volume in the same run.

A one-brick GlusterFS volume on loopback, mounted twice (tools/gluster/
loopback.py); for each delay of ``--delays-us`` (default 0, 500, 2000 µs
per file operation, GlusterFS's ``debug/delay-gen`` on the brick, set by
tools/gluster/delay.py):

1. the delay set (the volume restarted, both mounts reconnected) and
   checked: the median of 50 stats of missing names from the second mount,
   and the brick's count of file operations they cost;
2. tools/bench/lookup.py: the existence check of one prompt of
   ``--lookup-keys`` blocks, all hits and all misses, written through mount
   A and checked through mount B, ours over a lookup_threads sweep against
   the built-in's own lookup path and plain stat, and single checks in
   round trips (net of the same check at delay 0, which therefore runs
   first) and in the brick's file operations;
3. tools/bench/engine.py through mount A: one long prompt (one job of
   ``--long-blocks`` blocks) and many jobs (``--many-blocks`` in jobs of
   ``--blocks-per-job``), store then load, ours (I/O threads,
   ``--per-side`` each side) against the built-in (``--builtin-threads``
   each side); with ``--small-block-mib`` the long prompt again at that
   block size.

The benchmarks run from this tree as subprocesses, one at a time. Writes
``latency.json`` (everything, the machine and the load average before and
after) and ``latency.md`` (the tables) into ``--out``. Root, /dev/fuse and
GlusterFS needed (installed when missing, as the tests do)::

    python -m tools.bench.builtin_payload          # once, where vLLM 0.33 is
    python -m tools.bench.latency --builtin .bench_payload --out latency-run

``--render DIR`` only re-renders ``DIR/latency.json`` into its tables (they
are tools/bench/latency_report.py's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from llmkv_fs.harness.machine import machine_info
from tools.bench.latency_report import default_lookup_threads, render
from tools.gluster import delay, glusterd, loopback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAT_SAMPLES = 50
BENCH_TIMEOUT_S = 1800.0


def int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"a comma list of counts, not {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench.latency", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", help="directory for latency.json and latency.md (and each run's JSON)")
    p.add_argument("--render", metavar="DIR", help="only render DIR/latency.json's tables")
    p.add_argument("--builtin", metavar="PAYLOAD_DIR", help="vLLM's built-in (builtin_payload)")
    p.add_argument("--delays-us", type=int_list, default=[0, 500, 2000])
    p.add_argument(
        "--server-threads",
        type=int,
        default=64,
        help="brick I/O threads (delay-gen sleeps in them; GlusterFS's default is 16)",
    )
    p.add_argument(
        "--volume", help="use this volume (made by `python -m tools.gluster up`), not a new one"
    )
    p.add_argument("--lookup-keys", type=int, default=2048)
    p.add_argument("--lookup-threads", default="4,8,16,32,64")
    p.add_argument("--lookup-rounds", type=int, default=2)
    p.add_argument("--single-keys", type=int, default=256)
    p.add_argument("--long-blocks", type=int, default=256)
    p.add_argument("--many-blocks", type=int, default=256)
    p.add_argument("--blocks-per-job", type=int, default=8)
    p.add_argument("--per-side", type=int, default=16, help="ours: I/O threads per side")
    p.add_argument("--builtin-threads", type=int, default=16, help="built-in: threads per side")
    p.add_argument("--engine-rounds", type=int, default=3)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument(
        "--small-block-mib",
        type=float,
        default=0.0,
        help="also the long prompt at this block size (0: not)",
    )
    p.add_argument("--skip-lookup", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args(argv)
    if not args.render and not (args.out and args.builtin):
        p.error("--out and --builtin are required (or --render DIR)")
    if args.delays_us and args.delays_us[0] != 0 and not args.skip_lookup:
        p.error("--delays-us must start with 0: round trips are net of the undelayed check")
    return args


# -- the run -------------------------------------------------------------------------------


def run_bench(module: str, argv: list[str]) -> int:
    """``python -m MODULE ARGV`` from this tree, its output passed through."""
    cmd = [sys.executable, "-m", module, *argv]
    print("$ " + " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=REPO, timeout=BENCH_TIMEOUT_S, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"# {module} did not finish in {BENCH_TIMEOUT_S:.0f} s", flush=True)
        return 124


def load_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def slim_engine(engine: dict | None) -> dict | None:
    """An engine run's JSON without every run's figures (medians kept)."""
    if engine is None:
        return None
    rows = [{k: v for k, v in row.items() if k not in ("runs",)} for row in engine["rows"]]
    return {"machine": engine["machine"], "args": engine["args"], "rows": rows}


def check_delay(vol: loopback.Volume, us: int) -> dict:
    """The p50 of negative stats from mount B, and the brick fops they cost."""
    probe = delay.probe_dir(vol)
    delay.profile_counts(vol.volume)  # from here on: only the stats below are counted
    p50 = delay.negative_stat_p50(probe, STAT_SAMPLES)
    counted = delay.profile_counts(vol.volume)
    fops = {k: v / STAT_SAMPLES for k, v in counted.items() if k != "STATFS"}
    if us and p50 < 0.8 * us / 1e6:
        raise SystemExit(
            f"the delay of {us} µs is not applied: negative stat p50 {p50 * 1e3:.2f} ms"
        )
    return {"stat_p50_s": p50, "stat_fops_per_call": fops}


def gluster_version() -> str:
    done = glusterd.run(["glusterfs", "--version"])
    return done.stdout.split("\n", 1)[0].replace("glusterfs", "").strip() or "?"


@dataclasses.dataclass
class Matrix:
    """One run of the matrix: its options, where it writes, and the volume
    it measures (``made``: brought up by this run, so taken down by it)."""

    args: argparse.Namespace
    out: str
    payload: str
    vol: loopback.Volume
    made: bool

    @property
    def lookup_dirs(self) -> tuple[str, str]:
        """The lookup benchmark's directory through mount A (written) and B (checked)."""
        return os.path.join(self.vol.mount_a, "lookup"), os.path.join(self.vol.mount_b, "lookup")

    @property
    def engine_dir(self) -> str:
        return os.path.join(self.vol.mount_a, "engine")

    def json_path(self, name: str) -> str:
        return os.path.join(self.out, f"{name}.json")


def prepare_lookup(m: Matrix) -> int:
    """The lookup benchmark's files, written once at no delay for every delay."""
    write, check = m.lookup_dirs
    return run_bench(
        "tools.bench.lookup",
        [
            "--dir", write, "--check-dir", check, "--phase", "prepare",
            "--keys", str(m.args.lookup_keys), "--builtin", m.payload,
        ],
    )  # fmt: skip


def measure_lookup(m: Matrix, us: int, base_json: str | None) -> tuple[int, dict | None]:
    """The lookup benchmark at delay ``us``: its exit status and its JSON
    (every round's figures left out)."""
    a, (write, check) = m.args, m.lookup_dirs
    path = m.json_path(f"lookup-{us}")
    argv = [
        "--dir", write, "--check-dir", check, "--phase", "measure",
        "--keys", str(a.lookup_keys), "--threads", a.lookup_threads,
        "--rounds", str(a.lookup_rounds), "--single-keys", str(a.single_keys),
        "--builtin", m.payload, "--delay-us", str(us),
        "--gluster-volume", m.vol.volume, "--json", path,
    ]  # fmt: skip
    if base_json:
        argv += ["--base-json", base_json]
    status = run_bench("tools.bench.lookup", argv)
    got = load_json(path)
    if got:
        got.pop("runs", None)
    return status, got


def measure_engine(m: Matrix, us: int) -> tuple[int, dict[str, Any]]:
    """The engine benchmark at delay ``us``: its exit status and, by entry
    key, its JSON (the long prompt and many jobs; the long prompt at
    ``--small-block-mib`` too, when asked)."""
    a = m.args
    common = [
        "--dir", m.engine_dir, "--mode", "threads", "--numa", "off",
        "--per-side", str(a.per_side), "--builtin", m.payload,
        "--builtin-threads", str(a.builtin_threads), "--rounds", str(a.engine_rounds),
    ]  # fmt: skip
    path = m.json_path(f"engine-{us}")
    status = run_bench(
        "tools.bench.engine",
        [*common, "--case", "long", "--case", "many",
         "--long-blocks", str(a.long_blocks), "--blocks", str(a.many_blocks),
         "--blocks-per-job", str(a.blocks_per_job),
         "--block-mib", str(a.block_mib), "--json", path],
    )  # fmt: skip
    got = {"engine": slim_engine(load_json(path))}
    if a.small_block_mib:
        path = m.json_path(f"engine-{us}-small")
        status |= run_bench(
            "tools.bench.engine",
            [*common, "--case", "long", "--long-blocks", str(a.long_blocks),
             "--block-mib", str(a.small_block_mib), "--json", path],
        )  # fmt: skip
        got["engine_small"] = slim_engine(load_json(path))
    return status, got


def measure_delay(m: Matrix, us: int, base_json: str | None) -> tuple[int, dict[str, Any]]:
    """Everything at delay ``us``: the delay set and checked, then each
    benchmark not skipped. Returns the exit status and the delay's entry."""
    entry: dict[str, Any] = {"us": us, "load_before": os.getloadavg()}
    entry["restart_s"] = delay.set_delay(m.vol, us, server_threads=m.args.server_threads)
    entry.update(check_delay(m.vol, us))
    print(
        f"# delay {us} µs: negative stat p50 {entry['stat_p50_s'] * 1e3:.2f} ms, "
        f"fops {entry['stat_fops_per_call']}",
        flush=True,
    )
    status = 0
    if not m.args.skip_lookup:
        code, entry["lookup"] = measure_lookup(m, us, base_json)
        status |= code
    if not m.args.skip_engine:
        code, engines = measure_engine(m, us)
        status |= code
        entry.update(engines)
    entry["load_after"] = os.getloadavg()
    return status, entry


def release(m: Matrix) -> None:
    """The volume down if this run made it; else as it was, less what this
    run wrote."""
    if m.made:
        loopback.down(m.vol)
    else:
        delay.set_delay(m.vol, 0)
        for path in (m.lookup_dirs[0], m.engine_dir):
            shutil.rmtree(path, ignore_errors=True)


def run_matrix(m: Matrix, result: dict[str, Any]) -> int:
    """Every delay in turn, ``result`` saved after each; returns 1 when
    any benchmark failed."""
    status = 0
    result["machine"] = machine_info([m.vol.mount_a, m.vol.mount_b])
    os.makedirs(m.engine_dir, exist_ok=True)
    delay.profile_start(m.vol.volume)
    if not m.args.skip_lookup:
        delay.set_delay(m.vol, 0, server_threads=m.args.server_threads)
        status |= prepare_lookup(m)
    base_json = None
    for us in m.args.delays_us:
        code, entry = measure_delay(m, us, base_json)
        status |= code
        # Round trips are net of the undelayed check: delay 0's JSON is every later one's base.
        if us == 0 and not m.args.skip_lookup:
            base_json = m.json_path(f"lookup-{us}")
        result["delays"].append(entry)
        save(m.out, result)
    return 1 if status else 0


def rerender(directory: str) -> int:
    earlier = load_json(os.path.join(directory, "latency.json"))
    if earlier is None:
        raise SystemExit(f"no latency.json in {directory}")
    print(render(earlier), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        return rerender(args.render)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    result: dict[str, Any] = {
        "args": vars(args),
        "load_before": os.getloadavg(),
        "headline_threads": default_lookup_threads(),
        "gluster_version": gluster_version(),
        "delays": [],
    }
    made = args.volume is None
    vol = loopback.bring_up(loopback.BENCH_PREFIX) if made else loopback.find(args.volume)
    result["volume"] = {"name": vol.volume, "mount_a": vol.mount_a, "mount_b": vol.mount_b}
    m = Matrix(args, out, os.path.abspath(args.builtin), vol, made)
    try:
        status = run_matrix(m, result)
    finally:
        result["load_after"] = os.getloadavg()
        try:
            release(m)
        finally:
            save(out, result)
    print(render(result), end="")
    return status


def save(out: str, result: dict) -> None:
    with open(os.path.join(out, "latency.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    if result.get("machine"):
        with open(os.path.join(out, "latency.md"), "w", encoding="utf-8") as f:
            f.write(render(result))


if __name__ == "__main__":
    sys.exit(main())
