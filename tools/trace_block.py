"""Which product files one block's store, load and lookup cross, traced on a
real engine: for each operation, the files of ``llmkv_fs`` whose functions
ran (every thread of this process: the owner, I/O threads, lookup threads,
housekeeping excluded), in the order first entered, the Python calls made
(the product's and all), and the re-entries -- calls into a file that was
entered before during the operation, on the same thread:

* ``callback``: the file is still on the thread's stack below the caller
  (a function handed down and called from below);
* ``again``: the file was entered and left, and is entered again (a second
  trip into the same module; the I/O thread's ``take`` then publish into
  the scheduler is one).

Each call the owner makes (``submit_store``, ``take_finished``, ``lookup``)
is a walk of its own; an executor's thread is followed until it gives the
block back (``slice_done`` returns). Also listed: calls into the owner's
module (``engine/engine.py``) from any other thread -- a call back up.

From the repository's root::

    python -m tools.trace_block [--mode threads|workers|both] [--block-size 64K] [--python-path]

``workers`` mode (I/O worker processes) traces the engine's process and,
through a ``sitecustomize`` this tool puts on the workers' ``PYTHONPATH``,
each worker: every batch of job records it takes (``take_jobs``) starts a
walk of its own there, followed until its result records are written (the
worker's publish), and the walk that ran while the owner's store (or load)
was traced is reported as its worker side; the operation's files "in
all" are the union of both sides. The tool is for measuring; the product
never imports it.
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
# An executor's thread has done its part of the operation once one of these
# returns (it gives the block back); what it does next is its next wait.
PUBLISH = frozenset(("slice_done",))
# A worker process has done its part once its results are written back
# (child.py's write of the result records); what follows is its next wait.
PUBLISH_IN_WORKER = "_write_all"
OWNER_MODULE = "engine/engine.py"


def _package_dir() -> str:
    import llmkv_fs

    return os.path.dirname(os.path.abspath(llmkv_fs.__file__)) + os.sep


class Tracer:
    """A profile function on every thread (installed before the engine
    starts its threads), recording only between ``begin`` and ``end``."""

    def __init__(self, package_dir: str, skip_threads: Callable[[str], bool], owner: int) -> None:
        self._pkg = package_dir
        self._owner = owner
        self.owner_paused = False
        self._root = os.path.dirname(package_dir.rstrip(os.sep)) + os.sep
        self._skip = skip_threads
        self._on = False
        self._lock = threading.Lock()
        self._rel: dict[str, str | None] = {}
        self.reset()

    def reset(self) -> None:
        self.first: list[str] = []  # product files in the order first entered
        self.seen: set[str] = set()
        self.calls = 0
        self.product_calls = 0
        self.reentries: list[dict[str, str]] = []
        self._entered: dict[int, set[str]] = collections.defaultdict(set)
        self._published: set[int] = set()
        self.threads: set[str] = set()
        self.by_thread: dict[str, list[str]] = {}
        # Calls into the owner's module (engine/engine.py) made by a thread
        # that is not the owner: a call back up from below.
        self.upcalls: list[str] = []

    def begin(self) -> None:
        self.reset()
        self._on = True

    def end(self) -> dict[str, Any]:
        self._on = False
        return {
            "files": list(self.first),
            "n_files": len(self.first),
            "python_calls": self.calls,
            "product_calls": self.product_calls,
            "reentries": list(self.reentries),
            "n_reentries": len(self.reentries),
            "threads": sorted(self.threads),
            "by_thread": dict(self.by_thread),
            "owner_module_upcalls": list(self.upcalls),
        }

    def _product(self, filename: str) -> str | None:
        rel = self._rel.get(filename, "")
        if rel == "":
            path = os.path.abspath(filename)
            rel = path[len(self._root) :] if path.startswith(self._pkg) else None
            self._rel[filename] = rel
        return rel

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if not self._on or event not in ("call", "return"):
            return
        ident = threading.get_ident()
        if ident == self._owner:
            if self.owner_paused:
                return
        elif ident in self._published:
            return  # its block is given back: what follows is its next wait
        if event == "return":
            if frame.f_code.co_name in PUBLISH and ident != self._owner:
                self._published.add(ident)
            return
        name = threading.current_thread().name
        if self._skip(name):
            return
        with self._lock:
            self.calls += 1
            here = self._product(frame.f_code.co_filename)
            if here is None:
                return
            self.product_calls += 1
            self.threads.add(name)
            mine = self.by_thread.setdefault(name, [])
            if here not in mine:
                mine.append(here)
            if ident != self._owner and here.endswith(OWNER_MODULE):
                self.upcalls.append(f"{here}:{frame.f_code.co_name} [{name}]")
            if here not in self.seen:
                self.seen.add(here)
                self.first.append(here)
            below: list[str] = []
            back = frame.f_back
            while back is not None:
                rel = self._product(back.f_code.co_filename)
                if rel is not None:
                    below.append(rel)
                back = back.f_back
            caller = below[0] if below else None
            entered = self._entered[ident]
            if caller is None:  # one call of the owner's: a walk of its own
                entered.clear()
            if caller != here:
                kind = None
                if here in below:
                    kind = "callback"
                elif here in entered:
                    kind = "again"
                if kind is not None:
                    self.reentries.append(
                        {
                            "kind": kind,
                            "into": f"{here}:{frame.f_code.co_name}",
                            "from": caller or "?",
                            "thread": name,
                        }
                    )
            entered.add(here)


def _primary(size: int) -> mmap.mmap:
    """A primary buffer worker processes can map (a memfd, like vLLM's /dev/shm file)."""
    fd = os.memfd_create("llmkv_trace_primary", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    primary = mmap.mmap(fd, size)
    os.close(fd)
    return primary


# Imported by each worker process at start-up (Python's site hook), from a
# temporary directory put first on the workers' PYTHONPATH: one Tracer per
# worker, a walk per batch of job records, written out when the worker ends.
_WORKER_HOOK = """
import atexit, json, os, sys, threading, time
from tools.trace_block import Tracer, _package_dir

from tools.trace_block import PUBLISH_IN_WORKER

_tracer = Tracer(_package_dir(), lambda name: False, threading.get_ident())
_walks = []

def _profile(frame, event, arg):
    name = frame.f_code.co_name
    if event == "call" and name == "take_jobs":
        if _tracer._on:
            _walks[-1].update(_tracer.end())
        _walks.append({"t": time.monotonic()})
        _tracer.begin()
    _tracer.profile(frame, event, arg)
    if event == "return" and name == PUBLISH_IN_WORKER and _tracer._on:
        _walks[-1].update(_tracer.end())  # its results are written: the worker's publish

def _write():
    sys.setprofile(None)
    if _tracer._on:
        _walks[-1].update(_tracer.end())
    with open(os.path.join(os.environ["LLMKV_FS_TRACE_WORKERS"], f"{os.getpid()}.json"), "w") as f:
        json.dump(_walks, f)

atexit.register(_write)
sys.setprofile(_profile)
"""


def _trace_workers(hook_dir: str, out_dir: str) -> None:
    """Workers started from now on trace themselves into ``out_dir``."""
    with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
        f.write(_WORKER_HOOK)
    os.environ["LLMKV_FS_TRACE_WORKERS"] = out_dir
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (hook_dir, _repo_root(), os.environ.get("PYTHONPATH")) if p
    )


def _repo_root() -> str:
    return os.path.dirname(_package_dir().rstrip(os.sep))


def _worker_side(
    report: dict[str, Any], out_dir: str, spans: dict[str, tuple[float, float]]
) -> None:
    """Each traced operation's worker walk (the one that began while it was
    traced and ran a block), and its files in all."""
    walks = []
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            walks += [w for w in json.load(f) if "files" in w]
    for op, (begin, end) in spans.items():
        ran = [
            w
            for w in walks
            if begin <= w["t"] <= end and any("engine/block/" in p for p in w["files"])
        ]
        if len(ran) != 1:
            raise RuntimeError(f"{op}: {len(ran)} worker walks ran a block, not one")
        report[op]["worker"] = ran[0]
        both = list(report[op]["files"])
        both += [p for p in ran[0]["files"] if p not in both]
        report[op]["files_in_all"] = both


def trace(mode: str, block_size: int, directory: str, compiled: bool = True) -> dict[str, Any]:
    """The walks of one block's store, load and lookup in ``mode`` (the
    ``compiled_io`` setting: ``compiled``). Leaves the process as it found
    it (profile functions, environment, files)."""
    workers_dir = tempfile.mkdtemp(prefix="llmkv_fs_trace_")
    saved_env = dict(os.environ)
    try:
        if mode == "workers":
            os.mkdir(os.path.join(workers_dir, "hook"))
            os.mkdir(os.path.join(workers_dir, "out"))
            _trace_workers(os.path.join(workers_dir, "hook"), os.path.join(workers_dir, "out"))
        report, spans = _traced_run(mode, block_size, directory, compiled)
        if mode == "workers":
            _worker_side(report, os.path.join(workers_dir, "out"), spans)
        return report
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(workers_dir, ignore_errors=True)


def _traced_run(
    mode: str, block_size: int, directory: str, compiled: bool
) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
    # Housekeeping runs on its own clock, not for the block: left out.
    tracer = Tracer(
        _package_dir(), lambda name: "housekeep" in name or "keeper" in name, threading.get_ident()
    )
    spans: dict[str, tuple[float, float]] = {}
    threading.setprofile(tracer.profile)
    sys.setprofile(tracer.profile)
    engine, primary = _engine(mode, block_size, directory, compiled)
    key = os.urandom(32) + bytes(4)
    report: dict[str, Any] = {"mode": mode, "block_size": block_size}
    report["io_workers"] = engine.io_workers
    try:
        # Warm up a different key: imports, per-thread scratch, descriptors.
        _store_and_load(engine, os.urandom(32) + bytes(4), 100)
        _lookup(engine, os.urandom(32) + bytes(4), "warm", tracer)

        began = time.monotonic()
        tracer.begin()
        assert engine.submit_store(1, [key], [0])
        _drain(engine, tracer)
        (stored,) = engine.take_finished()
        report["store"] = tracer.end()
        spans["store"] = (began, time.monotonic())
        assert stored.success, stored

        began = time.monotonic()
        tracer.begin()
        assert engine.submit_load(2, [key], [1])
        _drain(engine, tracer)
        (loaded,) = engine.take_finished()
        report["load"] = tracer.end()
        spans["load"] = (began, time.monotonic())
        assert loaded.success, loaded
        assert primary[block_size : 2 * block_size] == primary[:block_size]

        report["lookup"] = _lookup(engine, key, "req", tracer)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        engine.shutdown()
    return report, spans


def _engine(
    mode: str, block_size: int, directory: str, compiled: bool = True
) -> tuple[Any, mmap.mmap]:
    from llmkv_fs.config import TierSettings
    from llmkv_fs.engine import FsEngine
    from llmkv_fs.layout.paths import CacheLayout

    settings = TierSettings(
        root_dir=directory,
        io_workers=2 if mode == "workers" else 0,
        n_read_threads=1,
        n_write_threads=1,
        lookup_threads=1,
        compiled_io=compiled,
    )
    layout = CacheLayout(directory, {"model_name": "trace/block", "block_size": block_size}, 0)
    primary = _primary(4 * block_size)
    primary[:] = os.urandom(4 * block_size)
    return FsEngine(settings, layout, primary, block_size), primary


def bare(
    mode: str, block_size: int, directory: str, n: int, phases: str, compiled: bool = True
) -> None:
    """No tracing: ``n`` one-block store jobs, then (``phases`` "store,load")
    as many loads of them, each job waited for, after a warm-up; for
    counting system calls from outside (``--syscalls``)."""
    engine, _primary_buffer = _engine(mode, block_size, directory, compiled)
    try:
        _store_and_load(engine, os.urandom(32) + bytes(4), 1 << 30)
        keys = [os.urandom(32) + bytes(4) for _ in range(n)]
        for phase in phases.split(","):
            for i, key in enumerate(keys):
                if phase == "store":
                    assert engine.submit_store(i, [key], [0])
                elif phase == "load":
                    assert engine.submit_load(i, [key], [1])
                else:
                    continue
                engine.drain()
                (job,) = engine.take_finished()
                assert job.success, job
    finally:
        engine.shutdown()


_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def syscalls(mode: str, block_size: int, n: int, compiled: bool = True) -> dict[str, Any]:
    """System calls per one-block store job and per load job, every process
    of the engine (``strace -f``: its threads and worker processes), as the
    difference of runs with and without the phase."""

    def count(phases: str) -> dict[str, int]:
        with (
            tempfile.TemporaryDirectory() as directory,
            tempfile.NamedTemporaryFile("r", suffix=".strace") as out,
        ):
            argv = ["strace", "-f", "-c", "-o", out.name, sys.executable, "-m"]
            argv += ["tools.trace_block", "--bare", phases, "--mode", mode]
            argv += ["--block-size", str(block_size), "--blocks", str(n), "--dir", directory]
            argv += [] if compiled else ["--python-path"]
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"strace: {done.stderr[-2000:]}")
            calls: dict[str, int] = {}
            for line in out.read().splitlines():
                match = _STRACE_ROW.match(line)
                if match and match.group(2) != "total":
                    calls[match.group(2)] = int(match.group(1))
            return calls

    none, stored, both = count("none"), count("store"), count("store,load")
    report: dict[str, Any] = {}
    for phase, base, top in (("store", none, stored), ("load", stored, both)):
        names = set(base) | set(top)
        delta = {name: (top.get(name, 0) - base.get(name, 0)) / n for name in names}
        report[phase] = round(sum(delta.values()), 1)
        report[f"{phase}_calls"] = {k: round(v, 2) for k, v in sorted(delta.items()) if v >= 0.05}
    return report


def _drain(engine: Any, tracer: Tracer) -> None:
    """Wait for the job (not part of a block's path: the tier polls
    ``take_finished`` instead)."""
    tracer.owner_paused = True
    engine.drain()
    tracer.owner_paused = False


def _store_and_load(engine: Any, key: bytes, job_id: int) -> None:
    assert engine.submit_store(job_id, [key], [2])
    engine.drain()
    engine.take_finished()
    assert engine.submit_load(job_id + 1, [key], [3])
    engine.drain()
    engine.take_finished()


def _lookup(engine: Any, key: bytes, request: str, tracer: Tracer) -> dict[str, Any]:
    """One key looked up until answered: the first call (it starts the
    check) and the answering one are traced, with everything the lookup
    thread does in between; the owner's polls between them are not."""
    tracer.begin()
    verdict = engine.lookup(key, request)
    deadline = time.monotonic() + 10.0
    while verdict is None and time.monotonic() < deadline:
        tracer.owner_paused = True
        time.sleep(0.002)
        engine.end_step()
        tracer.owner_paused = False
        verdict = engine.lookup(key, request)
    report = tracer.end()
    report["verdict"] = verdict
    engine.forget_request(request)
    return report


def _print(report: dict[str, Any]) -> None:
    size = report["block_size"]
    label = f"{size // KiB}K" if size < MiB else f"{size // MiB}M"
    print(f"== {report['mode']} (io_workers={report['io_workers']}), block {label}")
    for op in ("store", "load", "lookup"):
        got = report[op]
        print(
            f"  {op}: {got['n_files']} product files, {got['n_reentries']} re-entries, "
            f"{got['product_calls']} product calls of {got['python_calls']} Python calls"
        )
        for i, path in enumerate(got["files"], 1):
            print(f"    {i:2d}. {path}")
        for thread, files in got["by_thread"].items():
            print(f"    on {thread}: {len(files)} files")
        for call in got["owner_module_upcalls"]:
            print(f"    call up into the owner's module: {call}")
        for r in got["reentries"]:
            print(f"    re-entry ({r['kind']}): {r['from']} -> {r['into']}  [{r['thread']}]")
        worker = got.get("worker")
        if worker is not None:
            print(
                f"    in the worker: {worker['n_files']} product files, "
                f"{worker['n_reentries']} re-entries, {worker['product_calls']} product calls"
            )
            for i, path in enumerate(worker["files"], 1):
                print(f"      {i:2d}. {path}")
            for r in worker["reentries"]:
                print(f"      re-entry ({r['kind']}): {r['from']} -> {r['into']}")
            print(f"    in all (both processes): {len(got['files_in_all'])} product files")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("threads", "workers", "both"), default="both")
    parser.add_argument("--block-size", default="64K", help="e.g. 64K, 2M")
    parser.add_argument("--dir", help="a directory to use (default: a fresh temporary one)")
    parser.add_argument("--json", metavar="PATH", help="also write the reports as JSON")
    parser.add_argument(
        "--syscalls",
        type=int,
        metavar="N",
        default=0,
        help="also count system calls per one-block store and load job (strace -f, N jobs)",
    )
    parser.add_argument(
        "--python-path",
        action="store_true",
        help="the Python byte path and presence check (compiled_io off)",
    )
    parser.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--bare", metavar="PHASES", help=argparse.SUPPRESS)
    args = parser.parse_args()
    text = args.block_size.strip().upper()
    unit = {"K": KiB, "M": MiB}.get(text[-1:], 1)
    block_size = int(text[:-1] if unit != 1 else text) * unit
    modes = ("threads", "workers") if args.mode == "both" else (args.mode,)
    if args.bare:
        bare(modes[0], block_size, args.dir, args.blocks, args.bare, not args.python_path)
        return
    reports = []
    for mode in modes:
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            reports.append(trace(mode, block_size, directory, not args.python_path))
        _print(reports[-1])
        if args.syscalls:
            calls = syscalls(mode, block_size, args.syscalls, not args.python_path)
            reports[-1]["syscalls"] = calls
            for phase in ("store", "load"):
                print(f"  syscalls per {phase} job: {calls[phase]}  {calls[phase + '_calls']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
