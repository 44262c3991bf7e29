"""Existence checks of one long prompt (issue 26): how long our tier and
vLLM's built-in fs tier take to say, for every block of one prompt of
``--keys`` blocks (default 2,048), whether it is on the volume -- all hits,
then all misses -- from the first lookup to the last verdict.

* ours: FsEngine.lookup of every key, then end_step, once per scheduler
  step (as vLLM's tiering manager calls them), until every key has a
  verdict; ``--threads`` sweeps ``lookup_threads`` (the threads one step's
  batch is checked on);
* the built-in (``--builtin PAYLOAD_DIR``, tools/bench/builtin.py): its own
  lookup path, vLLM's unmodified ``AsyncLookupManager`` as its
  ``FsAsyncLookupManager`` uses it (``BuiltinLookups``): one batch per step
  to one background thread calling ``fs_io_C.batch_lookup`` on the
  FileMapper paths. Each side is asked through one frame standing for its
  tier's ``lookup`` (``FsTier.lookup``, ``FileSystemTierManager.lookup``),
  with one request's id or ReqContext, as vLLM passes them;
* plain stat: ``os.stat`` of each full path of our files on 1 and on each
  ``--threads`` count of threads, no tier at all (the reference: what the
  volume costs);
* single checks (``--single-keys``): that many checks one after the other on
  one thread -- ours (the check a lookup thread makes), plain stat and the
  built-in's batch_lookup -- per check, and in round trips: the time per
  check less the same check on the volume without delay (``--base-json``,
  an earlier run's JSON; else nothing is subtracted), divided by the
  volume's added delay per file operation (``--delay-us``). With
  ``--gluster-volume NAME`` the brick's own count of file operations per
  check (``gluster volume profile``) is reported beside it.

The files are made first (``--phase prepare``, through ``--dir``: each tier
stores the hits with its own store path) and checked through
``--check-dir``: the same directory through another client (a second mount
of a network volume: the replica that looks up is not the one that wrote),
by default ``--dir`` itself. Before each timed pass the run waits
``--settle-s`` (default 1.5 s, past GlusterFS's and NFS's 1 s client
caches of names and attributes), so every pass starts with nothing cached
on the client, as a new prompt meets the volume. Each configuration is
measured ``--rounds`` times, the order reversed every other round; the
median is reported.

    python -m tools.bench.lookup --dir /mnt/vol-a/lk --check-dir /mnt/vol-b/lk \\
        --builtin .bench_payload --delay-us 2000 --json lookup.json

The exit status is 1 when any verdict was wrong (a hit answered miss or a
miss answered hit), including ours' checks answered miss by the engine's
5 s lookup deadline (counted as ``expired``).

This module times the checks; the options are tools/bench/lookup_cli.py's,
the files and their prepare phase tools/bench/lookup_files.py's, the
summaries and tables tools/bench/lookup_report.py's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmkv_fs.engine import FsEngine, LookupAnswer
from llmkv_fs.harness.machine import machine_info
from llmkv_fs.layout.paths import CacheLayout
from tools.bench.lookup_cli import parse_args
from tools.bench.lookup_files import (
    Places,
    check_prepared,
    hit_keys,
    miss_keys,
    open_ours,
    prepare,
)
from tools.bench.lookup_report import CASES, render, single_rows, speedups, summarize
from tools.bench.support import IDENTITY
from tools.gluster.delay import profile_counts, profile_start

# -- timing ------------------------------------------------------------------------------


def verdicts_wrong(verdicts: Sequence[bool | None], expected: bool) -> int:
    return sum(1 for v in verdicts if v is not expected)


@dataclasses.dataclass
class Stepped:
    """What stepping one prompt until every key was known took: seconds
    from the first lookup to the step that saw the last verdict, steps,
    the scheduler thread's CPU seconds in lookups and ends of steps (its
    sleeps between steps not counted), and the verdicts."""

    s: float
    steps: int
    sched_cpu_s: float
    verdicts: list[bool | None]


def prefix_scan(lookup: Callable[[bytes], bool | None], keys: Sequence[bytes]) -> list:
    """One step of vLLM's ``_maximal_prefix_lookup``: every key asked in
    order, a RETRY (None) does not stop the scan, a MISS does. Returns the
    verdicts of the keys asked."""
    verdicts = []
    for key in keys:
        verdict = lookup(key)
        verdicts.append(verdict)
        if verdict is False:
            break
    return verdicts


def step_until_known(
    lookup: Callable[[bytes], bool | None],
    end_step: Callable[[], None],
    keys: Sequence[bytes],
    step_s: float,
    deadline_s: float = 600.0,
) -> Stepped:
    """Scheduler steps (``prefix_scan``, then the end of the step) until
    the prefix is known: every key up to the first miss has a verdict, as
    vLLM's scheduler needs. Timed to there; then, untimed, stepped on until
    every key has a verdict, so that all of them can be checked."""
    clock, cpu = time.perf_counter, time.thread_time
    start, cpu_start = clock(), cpu()
    steps = 0
    while None in prefix_scan(lookup, keys):
        if clock() - start > deadline_s:
            raise RuntimeError(f"verdicts still missing after {deadline_s:.0f} s")
        end_step()
        time.sleep(step_s)
        steps += 1
    steps += 1
    took, sched = clock() - start, cpu() - cpu_start
    while None in (verdicts := [lookup(k) for k in keys]):
        if clock() - start > deadline_s:
            raise RuntimeError(f"verdicts still missing after {deadline_s:.0f} s")
        end_step()
        time.sleep(step_s)
    return Stepped(took, steps, sched, verdicts)


def plain_stat(paths: Sequence[str], threads: int) -> tuple[float, list[bool]]:
    """``os.stat`` of each full path on ``threads`` threads: a regular file?"""

    def one(path: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(path).st_mode)
        except FileNotFoundError:
            return False

    start = time.perf_counter()
    if threads == 1:
        found = [one(p) for p in paths]
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            found = list(pool.map(one, paths))
    return time.perf_counter() - start, found


class FopCounter:
    """The brick's count of file operations (``gluster volume profile``)
    between ``reset`` and ``read``; a no-op without a volume."""

    def __init__(self, volume: str | None):
        self.volume = volume
        if volume:
            profile_start(volume)

    def reset(self) -> None:
        if self.volume:
            profile_counts(self.volume)

    def read(self) -> dict[str, int] | None:
        return profile_counts(self.volume) if self.volume else None


class Bench:
    """The timed passes over the prepared files, through the checking client."""

    def __init__(self, args: argparse.Namespace, places: Places, payload: Any):
        self.args, self.places, self.payload = args, places, payload
        self.block = args.block_kib * 1024
        self.step_s = args.step_ms / 1000
        self.keys = {"hit": hit_keys(args.keys), "miss": miss_keys(args.keys)}
        self._layout = CacheLayout.for_identity(places.ours(True), IDENTITY)
        self.plain_paths = {
            c: [self._layout.block_path(k) for k in ks] for c, ks in self.keys.items()
        }
        self.batch_lookup, self.batch_name = None, "-"
        if payload is not None:
            from tools.bench.builtin import builtin_batch_lookup, builtin_path

            self.batch_lookup, self.batch_name = builtin_batch_lookup()
            base = places.builtin_base(True)
            self.builtin_path: Callable[[bytes], str] = lambda k: builtin_path(base, k)
        self.fops = FopCounter(args.gluster_volume)

    def warm(self) -> None:
        """One untimed pass over every name of both cases in both trees
        (checking client), so every round meets the same client state:
        names seen once, their cached answers expired by the settle."""
        paths = [p for ps in self.plain_paths.values() for p in ps]
        if self.batch_lookup is not None:
            paths += [self.builtin_path(k) for ks in self.keys.values() for k in ks]
        plain_stat(paths, 16)

    def settle(self) -> None:
        if self.args.settle_s > 0:
            time.sleep(self.args.settle_s)

    def configurations(self) -> list[str]:
        labels = [f"ours/{t}" for t in self.args.threads]
        if self.payload is not None:
            labels.append("builtin")
        labels += [f"plain stat/{t}" for t in sorted({1, *self.args.threads})]
        return labels

    def run_config(self, label: str) -> dict[str, dict]:
        """Both cases of one configuration: ``ours/<lookup_threads>``,
        ``builtin`` or ``plain stat/<threads>``."""
        kind, _, count = label.partition("/")
        if kind == "ours":
            return {case: self._run_ours(case, int(count)) for case in CASES}
        if kind == "builtin":
            return self._run_builtin()
        return {case: self._run_plain_stat(case, int(count)) for case in CASES}

    def _run_ours(self, case: str, lookup_threads: int) -> dict:
        # A fresh engine per case: one case's deadline misses stay its own.
        engine, buffer = open_ours(self.places.ours(True), lookup_threads, self.block)
        try:
            self.settle()
            request = f"lookup-{case}-{time.monotonic_ns()}"
            lookup = engine.lookup

            def ask(key: bytes) -> bool | None:
                return lookup(key, request)  # as FsTier.lookup calls it: positionally

            got = step_until_known(ask, engine.end_step, self.keys[case], self.step_s)
            engine.forget_request(request)
            return {
                "s": got.s,
                "steps": got.steps,
                "sched_cpu_s": got.sched_cpu_s,
                "wrong": verdicts_wrong(got.verdicts, case == "hit"),
                "expired": engine.counters[LookupAnswer.DEADLINE_MISS],
            }
        finally:
            engine.shutdown()
            buffer.close()

    def _run_builtin(self) -> dict[str, dict]:
        from tools.bench.builtin import BuiltinLookups

        assert self.batch_lookup is not None
        lookups = BuiltinLookups(self.payload, self.builtin_path, self.batch_lookup)
        lookup = lookups.manager.lookup
        out = {}
        try:
            for case in CASES:
                self.settle()
                request = f"lookup-{case}-{time.monotonic_ns()}"
                context = lookups.context(request)

                def ask(key: bytes, context: Any = context) -> bool | None:
                    return lookup(key, context)  # as FileSystemTierManager.lookup calls it

                got = step_until_known(ask, lookups.flush, self.keys[case], self.step_s)
                lookups.cleanup(request)
                out[case] = {
                    "s": got.s,
                    "steps": got.steps,
                    "sched_cpu_s": got.sched_cpu_s,
                    "wrong": verdicts_wrong(got.verdicts, case == "hit"),
                }
        finally:
            lookups.close()
        return out

    def _run_plain_stat(self, case: str, threads: int) -> dict:
        self.settle()
        s, found = plain_stat(self.plain_paths[case], threads)
        return {"s": s, "wrong": verdicts_wrong(found, case == "hit")}

    def single(self) -> dict[str, dict[str, dict]]:
        """Sequential single checks of the first --single-keys keys of each case."""
        engine, buffer = open_ours(self.places.ours(True), 1, self.block)
        try:
            return {
                tool: {case: self._time_single_checks(tool, check, case) for case in CASES}
                for tool, check in self._single_checkers(engine).items()
            }
        finally:
            engine.shutdown()
            buffer.close()

    def _single_checkers(self, engine: FsEngine) -> dict[str, Callable[[list[bytes]], list[bool]]]:
        """Each tool's check of a list of keys, one key after the other."""
        exists = engine.roots[0].blockio.exists
        checkers: dict[str, Callable[[list[bytes]], list[bool]]] = {
            "ours": lambda keys: [exists(k) for k in keys],
            "plain stat": lambda keys: plain_stat([self.plain_paths_of(k) for k in keys], 1)[1],
        }
        if self.batch_lookup is not None:
            batch = self.batch_lookup
            checkers[f"builtin ({self.batch_name})"] = lambda keys: list(
                batch([self.builtin_path(k) for k in keys])
            )
        return checkers

    def _time_single_checks(
        self, tool: str, check: Callable[[list[bytes]], list[bool]], case: str
    ) -> dict:
        n = self.args.single_keys
        keys = self.keys[case][:n]
        self.settle()
        self.fops.reset()
        start = time.perf_counter()
        found = check(keys)
        took = time.perf_counter() - start
        counted = self.fops.read()
        wrong = verdicts_wrong(found, case == "hit")
        if wrong:
            raise RuntimeError(f"single checks, {tool}: {wrong} wrong {case} verdicts")
        return {
            "per_check_s": took / n,
            "fops_per_check": (
                {k: v / n for k, v in counted.items()} if counted is not None else None
            ),
        }

    def plain_paths_of(self, key: bytes) -> str:
        return self._layout.block_path(key)


def base_single(path: str | None) -> dict | None:
    """The single checks of an earlier run at delay 0 (by tool and case)."""
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        earlier = json.load(f)
    return earlier.get("single_raw")


def measure(args: argparse.Namespace, places: Places, payload: Any, info: dict) -> dict:
    bench = Bench(args, places, payload)
    bench.warm()
    labels = bench.configurations()
    runs: dict[str, dict[str, list[dict]]] = {label: {c: [] for c in CASES} for label in labels}
    for round_no in range(args.rounds):
        for label in labels if round_no % 2 == 0 else labels[::-1]:
            got = bench.run_config(label)
            for case in CASES:
                runs[label][case].append(got[case])
            print(
                f"# round {round_no + 1} {label}: "
                + ", ".join(f"{c} {got[c]['s']:.3f} s" for c in CASES),
                flush=True,
            )
    summary = summarize(runs)
    single = bench.single() if args.single_keys else {}
    result = {
        "machine": info,
        "args": dict(vars(args)),
        "builtin_lookup": bench.batch_name,
        "summary": summary,
        "speedups": speedups(summary, args.threads),
        "single_raw": single,
        "single": single_rows(single, args.delay_us, base_single(args.base_json)),
        "runs": runs,
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    payload = None
    if args.builtin:
        from tools.bench.builtin import load_payload

        payload = load_payload(args.builtin)
    places = Places(args.dir, args.check_dir)
    os.makedirs(args.dir, exist_ok=True)
    info = machine_info([args.dir, args.check_dir])
    print(f"# {info['node']}: {info['cpus']} CPUs, load {info['load_average']}", flush=True)
    try:
        if args.phase in ("prepare", "all"):
            record = prepare(args, places, payload)
            print(f"# prepared {args.keys} hits per tier: {record['store_s']}", flush=True)
            if args.phase == "prepare":
                return 0
        check_prepared(args, places, payload)
        result = measure(args, places, payload, info)
    finally:
        if args.phase == "all" and not args.keep:
            shutil.rmtree(places.top, ignore_errors=True)
    result["machine"]["load_average_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(render(result), end="")
    wrong = sum(c["wrong"] for cases in result["summary"].values() for c in cases.values())
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
