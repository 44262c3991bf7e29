"""What one block costs besides its bytes: wall-clock and CPU microseconds
per block of ``BlockIO.store``, ``load`` and ``exists`` (a hit and a miss),
one thread, and with ``--strace`` the system calls per block of each --
for one or more checkouts of llmkv_fs in the same run (issue 27: small
blocks, before and after). From the repository's root::

    python3 -m tools.bench.block_cost --dir /dev/shm/bc --checkout before=/tmp/base \\
        --checkout after=. --sizes 64K,512K,2M --blocks 400 --rounds 5 --strace

Each round runs every checkout in a fresh interpreter (its own PYTHONPATH),
in alternating order, on an emptied directory: it stores ``--blocks`` blocks
of random keys (new fan-out directories, as in a young cache), loads them
back and checks the bytes, then looks each one up and as many absent keys.
Options as the engine picks them on that volume (O_DIRECT where the probe
passes, hash pieces on tmpfs, checksum on, durability none). Reported: the
median over rounds per block, the load average before and after.
``--strace``: each phase's calls per block, counted by ``strace -f -c`` over
runs of 0 and ``--blocks`` blocks (the difference, so start-up is left out).
``--calls``: each phase's Python function calls per block (a profile
function counting them, in a run of its own so the timings are left alone).
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
PHASES = ("store", "load", "hit", "miss")


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, unit in (("K", KiB), ("M", MiB)):
        if text.endswith(suffix):
            return int(text[:-1]) * unit
    return int(text)


def _blockio(directory: str, block_size: int) -> Any:
    """The engine's BlockIO for ``directory``, with the options the engine
    would pick there (imported from this checkout or an older one)."""
    from llmkv_fs.config import TierSettings
    from llmkv_fs.layout.paths import CacheLayout

    try:  # this tree
        from llmkv_fs.engine.block.blockio import BlockIO
        from llmkv_fs.engine.startup.io_setup import io_options
        from llmkv_fs.engine.startup.probe import probe_o_direct
        from llmkv_fs.engine.upkeep.prepare import prepare_volume
        from llmkv_fs.volume.fsinfo import filesystem_type
    except ImportError:  # before issue 28's rooms (commit ce83199 and older)
        from llmkv_fs.engine.block.blockio import BlockIO
        from llmkv_fs.engine.block.io_setup import io_options  # type: ignore[import-not-found,no-redef]
        from llmkv_fs.engine.block.probe import probe_o_direct  # type: ignore[import-not-found,no-redef]
        from llmkv_fs.engine.volume.prepare import prepare_volume  # type: ignore[import-not-found,no-redef]
        from llmkv_fs.layout.fsinfo import filesystem_type  # type: ignore[import-not-found,no-redef]

    layout = CacheLayout(directory, {"model_name": "bench/block_cost", "block_size": block_size}, 0)
    prepared = prepare_volume(layout)
    settings = TierSettings(root_dir=directory)
    direct = probe_o_direct(layout.rank_dir, root=directory)
    options = io_options(settings, block_size, direct, filesystem_type(directory), prepared.root)
    return BlockIO(layout, options)


def child(
    directory: str,
    block_size: int,
    n_blocks: int,
    phases: tuple[str, ...],
    count_calls: bool = False,
) -> dict:
    """One measurement, inside the checkout's interpreter (``count_calls``:
    Python function calls per block of each phase, instead of times)."""
    blockio = _blockio(directory, block_size)
    rows = mmap.mmap(-1, block_size)
    rows[:] = os.urandom(block_size)
    row = memoryview(rows)
    back = mmap.mmap(-1, block_size)
    view = memoryview(back)
    keys = [os.urandom(32) + bytes(4) for _ in range(n_blocks)]
    absent = [os.urandom(32) + bytes(4) for _ in range(n_blocks)]
    blockio.store(os.urandom(32) + bytes(4), row)  # thread scratch, imports
    ops = {
        "store": (lambda key: blockio.store(key, row), keys),
        "load": (lambda key: blockio.load(key, view), keys),
        "hit": (blockio.exists, keys),
        "miss": (blockio.exists, absent),
    }
    result: dict[str, Any] = {"o_direct": blockio.options.use_o_direct}
    for phase in phases:
        op, which = ops[phase]
        calls = [0]
        if count_calls:
            sys.setprofile(functools.partial(_count, calls))
        wall, cpu = time.perf_counter(), time.process_time()
        answers = [op(key) for key in which]
        result[f"{phase}_us"] = (time.perf_counter() - wall) / max(1, n_blocks) * 1e6
        result[f"{phase}_cpu_us"] = (time.process_time() - cpu) / max(1, n_blocks) * 1e6
        sys.setprofile(None)
        # The list comprehension, and for a store or load its lambda per
        # block, are the harness's.
        harness = 1 if phase in ("store", "load") else 0
        result[f"{phase}_calls"] = (calls[0] - 1) / max(1, n_blocks) - harness
        if phase in ("hit", "miss"):
            assert all(answers) if phase == "hit" else not any(answers), phase
    if "load" in phases and n_blocks:
        assert back[:] == rows[:], "loaded bytes differ"
    return result


def _count(calls: list[int], _frame: object, event: str, _arg: object) -> None:
    if event == "call":
        calls[0] += 1


def _argv(directory: str, size: int, blocks: int, phases: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tools.bench.block_cost",
        "--child",
        directory,
        "--sizes",
        str(size),
        "--blocks",
        str(blocks),
        "--phases",
        ",".join(phases),
    ]


def _env(checkout: str) -> dict[str, str]:
    # The checkout first (its llmkv_fs), then this tree (tools), then the rest.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [os.path.abspath(checkout), here, os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))


def run_one(
    checkout: str, directory: str, size: int, blocks: int, count_calls: bool = False
) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    done = subprocess.run(
        _argv(directory, size, blocks, PHASES) + (["--count-calls"] if count_calls else []),
        env=_env(checkout),
        capture_output=True,
        text=True,
        check=False,
        cwd="/",  # nothing of this tree but what PYTHONPATH names
    )
    if done.returncode:
        raise SystemExit(f"{checkout}: {done.stderr}")
    result: dict = json.loads(done.stdout)
    return result


_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def strace_calls(checkout: str, directory: str, size: int, blocks: int) -> dict[str, float]:
    """System calls per block of each phase: strace -c over cumulative runs
    (store; store, load; ...), each minus the same run with no block."""

    def count(phases: tuple[str, ...], n: int) -> dict[str, int]:
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
            argv = ["strace", "-f", "-c", "-o", out.name, *_argv(directory, size, n, phases)]
            env = _env(checkout)
            done = subprocess.run(
                argv, env=env, capture_output=True, text=True, cwd="/", check=False
            )
            if done.returncode:
                raise SystemExit(f"strace {checkout}: {done.stderr[-2000:]}")
            calls: dict[str, int] = {}
            for line in out.read().splitlines():
                match = _STRACE_ROW.match(line)
                if match and match.group(2) != "total":
                    calls[match.group(2)] = int(match.group(1))
            return calls

    per_phase: dict[str, float] = {}
    before = count((), blocks)
    for i, phase in enumerate(PHASES):
        with_it = count(PHASES[: i + 1], blocks)
        names = set(with_it) | set(before)
        delta = {n: with_it.get(n, 0) - before.get(n, 0) for n in names}
        per_phase[phase] = sum(delta.values()) / blocks
        per_phase[f"{phase}_calls"] = {  # type: ignore[assignment]
            n: round(d / blocks, 2) for n, d in sorted(delta.items()) if d / blocks >= 0.05
        }
        before = with_it
    return per_phase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p = parser
    p.add_argument("--dir", default="/dev/shm/llmkv_bench_block_cost")
    p.add_argument("--checkout", action="append", default=[], metavar="LABEL=PATH")
    p.add_argument("--sizes", default="64K,2M")
    p.add_argument("--blocks", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--strace", action="store_true", help="also count system calls per block")
    p.add_argument("--calls", action="store_true", help="also count Python calls per block")
    p.add_argument("--json", metavar="PATH", help="write the medians (and calls) as JSON")
    p.add_argument("--count-calls", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--phases", default=",".join(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.child:
        phases = tuple(x for x in args.phases.split(",") if x)
        print(json.dumps(child(args.child, sizes[0], args.blocks, phases, args.count_calls)))
        return
    checkouts = [c.split("=", 1) for c in args.checkout] or [["this", "."]]
    load_before = os.getloadavg()
    samples: dict[tuple[str, int, str], list[float]] = {}
    for r in range(args.rounds):
        order = checkouts if r % 2 == 0 else checkouts[::-1]
        for size in sizes:
            for label, path in order:
                got = run_one(path, args.dir, size, args.blocks)
                for key, value in got.items():
                    samples.setdefault((label, size, key), []).append(float(value))
    calls = {}
    if args.strace:
        for size in sizes:
            for label, path in checkouts:
                calls[f"{label} {size // KiB}K"] = strace_calls(path, args.dir, size, args.blocks)
    python_calls = {}
    if args.calls:
        for size in sizes:
            for label, path in checkouts:
                got = run_one(path, args.dir, size, args.blocks, count_calls=True)
                python_calls[f"{label} {size // KiB}K"] = {ph: got[f"{ph}_calls"] for ph in PHASES}
    shutil.rmtree(args.dir, ignore_errors=True)
    load_after = os.getloadavg()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}")
    heads = [f"{ph}{c}" for ph in PHASES for c in ("", " cpu")]
    print(f"{'us/block':<10} {'block':>7} {' '.join(f'{h:>9}' for h in heads)}  o_direct")
    medians: dict[str, Any] = {}
    for size in sizes:
        for label, _path in checkouts:
            row = {
                f"{ph}{c}": statistics.median(samples[label, size, f"{ph}{c.replace(' ', '_')}_us"])
                for ph in PHASES
                for c in ("", " cpu")
            }
            direct = all(samples[label, size, "o_direct"])
            medians[f"{label} {size // KiB}K"] = {**row, "o_direct": direct}
            cells = " ".join(f"{row[h]:>9.1f}" for h in heads)
            print(f"{label:<10} {size // KiB:>6}K {cells}  {direct}")
    for name, per_phase in calls.items():
        cells = ", ".join(f"{phase} {per_phase[phase]:.1f}" for phase in PHASES)
        print(f"syscalls/block {name}: {cells}")
        for phase in PHASES:
            print(f"    {phase}: {per_phase[f'{phase}_calls']}")
    for name, per_phase in python_calls.items():
        cells = ", ".join(f"{phase} {per_phase[phase]:.1f}" for phase in PHASES)
        print(f"python calls/block {name}: {cells}")
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in load_after)}")
    if args.json:
        report = {"load_before": load_before, "load_after": load_after, "us_per_block": medians}
        with open(args.json, "w") as f:
            report["python_calls_per_block"] = python_calls
            json.dump({**report, "syscalls_per_block": calls}, f, indent=1)


if __name__ == "__main__":
    main()
