"""A soak: a tier inside vLLM's real scheduler-side manager for a very long
run of small jobs, every load checked byte for byte, the process measured
for growth (tools/soak/run.py, tests/system/test_soak.py).

The driver's ``Replica`` holds the real ``TieringOffloadingSpec`` ->
``TieringOffloadingManager`` and its ``/dev/shm`` CPU tier; this module plays
a scheduler with many requests open at once, each step under the manager's
lock:

* **stores**: fresh keys (never seen before, so every store writes a file)
  through ``prepare_store`` / ``complete_store``, which cascades one store
  job to the tier;
* **loads**: keys whose store job landed, looked up step by step (the tier
  answers RETRY, then HIT, the manager promotes, the load job lands, HIT);
  when all of a request's keys are HIT, ``prepare_load`` and the rows are
  compared with what was stored;
* **probes**: lookups of keys never stored, which must end MISS;
* **gc**: beyond ``files_kept`` landed keys, the oldest files are removed
  (as ``llmkv-fs gc`` would), so the volume stays small while keys churn
  and every per-key memory of the tier sees an unbounded key stream.

A job is one transfer job the manager handed the tier (``submit_store`` /
``submit_load``), counted when the tier reports it finished. Only the
SecondaryTierManager interface is used, so the same soak runs vLLM's
built-in fs tier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)

from llmkv_fs.harness.driver import Replica, offloading_config, payload_for
from tools.soak.probe import Snapshot, growth_problems, snapshot

_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
# Pause of a step that finished nothing: lets I/O threads have the GIL, as a
# real scheduler does while the model runs. Progress is polled, never slept on.
_IDLE_PAUSE_S = 0.0002


@dataclasses.dataclass(frozen=True)
class SoakPlan:
    jobs: int  # tier transfer jobs to finish
    row_bytes: int = 4096  # one CPU-tier row: small jobs
    cpu_rows: int = 512
    max_keys_per_job: int = 4
    store_jobs_in_flight: int = 16
    load_requests_open: int = 16
    probe_requests_open: int = 2
    files_kept: int = 2048
    checkpoints: int = 10  # quiescent snapshots after the warm one
    warmup_fraction: float = 0.1  # the warm snapshot: thread pools and arenas grown
    seed: int = 21
    stuck_after_s: float = 60.0
    progress: Callable[[str], None] | None = None


@dataclasses.dataclass
class Tally:
    store_jobs: int = 0
    load_jobs: int = 0
    failed_store_jobs: int = 0
    failed_load_jobs: int = 0
    lookups: int = 0
    blocks_checked: int = 0
    wrong_blocks: int = 0  # a load's row differs from what was stored
    phantom_hits: int = 0  # a never-stored key answered HIT
    lost_keys: int = 0  # a landed key's lookup ended MISS
    refused_stores: int = 0  # the CPU tier had no row
    files_removed: int = 0

    @property
    def jobs(self) -> int:
        return self.store_jobs + self.load_jobs

    def problems(self) -> list[str]:
        bad = {"wrong_blocks": self.wrong_blocks, "phantom_hits": self.phantom_hits}
        return [f"{what}: {count}" for what, count in bad.items() if count]


@dataclasses.dataclass
class SoakReport:
    seconds: float
    tally: Tally
    start: Snapshot  # before the first job
    warm: Snapshot  # the baseline growth is measured from
    end: Snapshot
    series: list[Snapshot]
    problems: list[str]

    @property
    def jobs_per_s(self) -> float:
        return self.tally.jobs / self.seconds

    def as_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["jobs_per_s"] = round(self.jobs_per_s)
        return fields


class SoakStuck(AssertionError):
    pass


def soak_key(kind: str, n: int) -> bytes:
    return make_offload_key(hashlib.sha256(f"soak-{kind}-{n}".encode()).digest(), 0)


class _JobWatch:
    """Wraps the tier's submit_store / submit_load / get_finished_jobs (the
    SecondaryTierManager interface the manager calls) to count jobs and learn
    which keys landed."""

    def __init__(self, tier: Any, tally: Tally, landed: Callable[[bytes], None]):
        self._open: dict[int, tuple[bool, list[bytes]]] = {}
        self.open_stores = 0
        self._tally = tally
        self._landed = landed
        submit_store, submit_load = tier.submit_store, tier.submit_load
        get_finished_jobs = tier.get_finished_jobs

        def store(job: Any) -> None:
            self._open[job.job_id] = (False, list(job.keys))
            self.open_stores += 1
            submit_store(job)

        def load(job: Any) -> None:
            self._open[job.job_id] = (True, list(job.keys))
            submit_load(job)

        def finished() -> Iterator[Any]:
            for result in get_finished_jobs():
                self._finish(result)
                yield result

        tier.submit_store, tier.submit_load, tier.get_finished_jobs = store, load, finished

    def _finish(self, result: Any) -> None:
        is_load, keys = self._open.pop(result.job_id)
        tally = self._tally
        if is_load:
            tally.load_jobs += 1
            tally.failed_load_jobs += not result.success
            return
        self.open_stores -= 1
        tally.store_jobs += 1
        tally.failed_store_jobs += not result.success
        for key in keys if result.success else (result.successful_keys or ()):
            self._landed(key)


@dataclasses.dataclass
class _Request:
    ctx: ReqContext
    keys: list[bytes]


class Soak:
    def __init__(self, replica: Replica, plan: SoakPlan, path_of: Callable[[bytes], str]):
        self.replica, self.plan, self.path_of = replica, plan, path_of
        self.manager = replica.manager
        self.tally = Tally()
        self.random = random.Random(plan.seed)
        self._volume: list[bytes] = []  # landed keys, oldest first from _head
        self._head = 0
        self._reserved: set[bytes] = set()  # keys of open load requests
        self._loads: list[_Request] = []
        self._probes: list[_Request] = []
        self._stored = self._probed = self._requests = 0
        self._draining = False
        self._idle_since = time.monotonic()
        self._watch = _JobWatch(replica.tier, self.tally, self._volume.append)

    # -- the run ---------------------------------------------------------------

    def run(self) -> SoakReport:
        plan = self.plan
        start = snapshot(0)
        began = time.monotonic()
        warm_at = max(1, int(plan.jobs * plan.warmup_fraction))
        after_warm = plan.jobs - warm_at
        marks = [warm_at + after_warm * i // plan.checkpoints for i in range(plan.checkpoints + 1)]
        series = []
        for mark in marks:
            series.append(self._run_until(mark))
            rate = self.tally.jobs / (time.monotonic() - began)
            self._say(f"{series[-1].brief()}, {rate:,.0f} jobs/s")
        seconds = time.monotonic() - began
        problems = self.tally.problems() + growth_problems(series[0], series[-1])
        return SoakReport(seconds, self.tally, start, series[0], series[-1], series, problems)

    def _run_until(self, jobs: int) -> Snapshot:
        """Run to ``jobs`` finished jobs, then let every open request and
        transfer finish (a quiescent point) and take a snapshot."""
        while self.tally.jobs < jobs:
            self._step_or_wait()
        self._draining = True
        try:
            while self._loads or self._probes or self._busy():
                self._step_or_wait()
        finally:
            self._draining = False
        return snapshot(self.tally.jobs)

    def _busy(self) -> bool:
        with self.manager.lock:
            return self.manager.has_pending_work()

    def _step_or_wait(self) -> None:
        """One scheduler step; a step that finished no job and no request
        pauses, and a soak that stays so for ``stuck_after_s`` fails."""
        now = time.monotonic()
        if self._step():
            self._idle_since = now
        elif now - self._idle_since > self.plan.stuck_after_s:
            raise SoakStuck(f"nothing finished for {self.plan.stuck_after_s}s: {self.tally}")
        else:
            time.sleep(_IDLE_PAUSE_S)

    def _step(self) -> bool:
        """Returns whether a job or a request finished."""
        jobs, requests = self.tally.jobs, len(self._loads) + len(self._probes)
        with self.manager.lock:
            self._loads = [r for r in self._loads if not self._advance_load(r)]
            self._probes = [r for r in self._probes if not self._advance_probe(r)]
            finished = requests - len(self._loads) - len(self._probes)
            if not self._draining:
                self._start_requests()
            self.manager.on_schedule_end(_STEP)
            # vLLM's scheduler takes the connector's stats every step
            # (update_from_output); they hold every lookup's and job's
            # observations until taken.
            self.manager.get_stats()
        self._remove_oldest_files()
        return bool(finished) or self.tally.jobs != jobs

    def _say(self, line: str) -> None:
        if self.plan.progress is not None:
            self.plan.progress(line)

    # -- requests (under the manager lock) -----------------------------------

    def _start_requests(self) -> None:
        plan = self.plan
        if self._watch.open_stores < plan.store_jobs_in_flight:
            self._start_store()
        if len(self._loads) < plan.load_requests_open:
            self._start_load()
        if len(self._probes) < plan.probe_requests_open:
            self._probed += 1
            first = self._probed * plan.max_keys_per_job
            keys = [soak_key("absent", first + i) for i in range(self._size())]
            self._probes.append(self._open_request(keys))

    def _size(self) -> int:
        return self.random.randint(1, self.plan.max_keys_per_job)

    def _open_request(self, keys: list[bytes]) -> _Request:
        self._requests += 1
        ctx = ReqContext(req_id=f"soak-{self._requests}")
        self.manager.on_new_request(ctx)
        return _Request(ctx, keys)

    def _start_store(self) -> None:
        self._stored += 1
        first = self._stored * self.plan.max_keys_per_job
        request = self._open_request([soak_key("stored", first + i) for i in range(self._size())])
        out = self.manager.prepare_store(request.keys, request.ctx)
        if out is None:
            self.tally.refused_stores += 1
        else:
            rows = self.replica.rows
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
                # Stand-in for the GPU->CPU copy, as Replica.store does.
                payload = payload_for(key, self.replica.row_bytes)
                rows[chunk, :] = np.frombuffer(payload, dtype=rows.dtype)
            self.manager.complete_store(list(out.keys_to_store), request.ctx)
        self.manager.on_request_finished(request.ctx)

    def _start_load(self) -> None:
        landed = len(self._volume) - self._head
        if landed < 4 * self.plan.max_keys_per_job:
            return
        keys: list[bytes] = []
        for _ in range(self._size()):
            key = self._volume[self.random.randrange(self._head, len(self._volume))]
            if key not in self._reserved and key not in keys:
                keys.append(key)
        if keys:
            self._reserved.update(keys)
            self._loads.append(self._open_request(keys))

    def _advance_load(self, request: _Request) -> bool:
        """One step of a load request; True when it is finished."""
        results = [self.manager.lookup(key, request.ctx) for key in request.keys]
        self.tally.lookups += len(results)
        if MISS in results:
            self.tally.lost_keys += results.count(MISS)
        elif all(result is HIT for result in results):
            self._check_rows(request)
        else:
            return False
        self.manager.on_request_finished(request.ctx)
        self._reserved.difference_update(request.keys)
        return True

    def _check_rows(self, request: _Request) -> None:
        spec = self.manager.prepare_load(request.keys, request.ctx)
        for key, chunk in zip(request.keys, spec.chunk_ids):
            expected = payload_for(key, self.replica.row_bytes)
            self.tally.wrong_blocks += self.replica.rows[chunk].tobytes() != expected
        self.tally.blocks_checked += len(request.keys)
        self.manager.complete_load(request.keys, request.ctx)

    def _advance_probe(self, request: _Request) -> bool:
        results = [self.manager.lookup(key, request.ctx) for key in request.keys]
        self.tally.lookups += len(results)
        self.tally.phantom_hits += sum(r in (HIT, HIT_PENDING) for r in results)
        if any(result is not MISS for result in results):
            return False
        self.manager.on_request_finished(request.ctx)
        return True

    # -- gc ----------------------------------------------------------------------

    def _remove_oldest_files(self) -> None:
        while len(self._volume) - self._head > self.plan.files_kept:
            key = self._volume[self._head]
            if key in self._reserved:  # an open load wants it: next step
                break
            self._head += 1
            os.unlink(self.path_of(key))
            self.tally.files_removed += 1
        if self._head > self.plan.files_kept:  # keep the list short
            del self._volume[: self._head]
            self._head = 0


def run_soak(tier: dict[str, Any], plan: SoakPlan, engine_id: str | None = None) -> SoakReport:
    """Soak one tier config (``driver.ours(...)`` / ``driver.builtin(...)``).
    ``engine_id`` names the CPU tier's ``/dev/shm`` region (random if None)."""
    config = offloading_config(
        tiers=[tier],
        block_bytes=plan.row_bytes,
        cpu_bytes=plan.row_bytes * plan.cpu_rows,
        engine_id=engine_id,
    )
    replica = Replica(config)
    try:
        tier_manager = replica.tier
        if hasattr(tier_manager, "engine"):  # ours
            path_of = tier_manager.engine.roots[0].layout.block_path
        else:  # vLLM's built-in
            path_of = tier_manager.file_mapper.get_file_name
        return Soak(replica, plan, path_of).run()
    finally:
        replica.close()
