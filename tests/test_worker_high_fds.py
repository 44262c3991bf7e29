"""A worker process whose pipes sit past file descriptor 1024 (found in
review, issue 20). The job and result pipes keep the owner's fd numbers in
the worker (``pass_fds``), and vLLM raises RLIMIT_NOFILE, so in its
engine-core process they may be numbered past 1024 -- where ``select()``
cannot watch them (``ValueError``) and the worker died at its first idle
moment, which the page-table filler made the moment right after start-up.

Real worker processes, a real rlimit, fds really past the limit.
"""

from __future__ import annotations

import json
import os
import resource

import pytest

from engine_kit import round_trip, worker_engine

HIGH = 1100  # past select()'s FD_SETSIZE of 1024


@pytest.fixture
def low_fds_taken():
    """Every fd below HIGH taken (by /dev/null), so the next ones opened --
    the engine's pipes -- are numbered past 1024. Restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * HIGH:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {2 * HIGH}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2 * HIGH), hard))
    taken: list[int] = []
    try:
        while not taken or taken[-1] < HIGH:
            taken.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def spec_of(pid: int) -> dict:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return json.loads(f.read().split(b"\0")[3])  # python -c CODE SPEC_JSON


@pytest.mark.usefixtures("low_fds_taken")
def test_workers_with_pipes_past_fd_1024_serve_and_idle(tmp_path):
    engine, primary = worker_engine(str(tmp_path / "kv"), 8)
    try:
        for pid in engine.executor.worker_pids():
            spec = spec_of(pid)
            assert spec["jobs_fd"] > 1024 and spec["results_fd"] > 1024
        round_trip(engine, primary, 8)
        assert engine.executor.deaths() == 0
    finally:
        engine.shutdown()
