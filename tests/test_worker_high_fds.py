"""A worker process whose pipes sit past file descriptor 1024 (found in
review, issue 20). The job and result pipes keep the owner's fd numbers in
the worker (``pass_fds``), and vLLM raises RLIMIT_NOFILE, so in its
engine-core process they may be numbered past 1024 -- where ``select()``
cannot watch them (``ValueError``) and the worker died at its first idle
moment, which the page-table filler made the moment right after start-up.

Real worker processes, a real rlimit, fds really past the limit.
"""

from __future__ import annotations

import gc
import json
import os
import resource

import pytest

from engine_kit import round_trip, worker_engine

HIGH = 1100  # past select()'s FD_SETSIZE of 1024


@pytest.fixture
def take_low_fds():
    """take() fills every free fd below HIGH (with /dev/null), so the next
    ones opened -- the engine's pipes -- are numbered past 1024; a call
    again takes what was freed meanwhile (an earlier test's thread ending,
    its garbage collected). All closed, the rlimit restored, afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * HIGH:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {2 * HIGH}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2 * HIGH), hard))
    taken: list[int] = []

    def take() -> None:
        gc.collect()
        while True:
            taken.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            if taken[-1] >= HIGH:
                return

    try:
        yield take
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def spec_of(pid: int) -> dict:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return json.loads(f.read().split(b"\0")[3])  # python -c CODE SPEC_JSON


def pipes_past_the_limit(engine) -> bool:
    specs = [spec_of(pid) for pid in engine.executor.worker_pids()]
    return all(spec["jobs_fd"] > 1024 and spec["results_fd"] > 1024 for spec in specs)


def test_workers_with_pipes_past_fd_1024_serve_and_idle(tmp_path, take_low_fds):
    for attempt in range(5):  # a low fd freed meanwhile: take it, start again
        take_low_fds()
        engine, primary = worker_engine(str(tmp_path / f"kv{attempt}"), 8)
        if pipes_past_the_limit(engine):
            break
        engine.shutdown()
    else:
        pytest.fail("the engine's pipes never got numbers past 1024")
    try:
        round_trip(engine, primary, 8)
        assert engine.executor.deaths() == 0
    finally:
        engine.shutdown()
