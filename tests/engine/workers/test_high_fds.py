"""File descriptors past 1024 (found in review, issues 20 and 25). vLLM
raises RLIMIT_NOFILE, so in its engine-core process the engine's fds may be
numbered past 1024 -- where ``select()`` cannot watch them (``ValueError``).
The job and result pipes keep the owner's numbers in a worker (``pass_fds``):
the worker died at its first idle moment. The conductor's wake eventfd: a
conductor that had failed and was failing every block died instead, and
the blocks given to it were never answered. No ``select()`` is left in the
product.

Real worker processes, a real rlimit, fds really past the limit.
"""

from __future__ import annotations

import ast
import gc
import os
import resource

import pytest

from llmkv_fs.engine import Direction, Failure
from llmkv_fs.engine.workers.crew import WorkerLaunch
from llmkv_fs.engine.workers.process_executor import ProcessExecutor
from tests.kits import REPO
from tests.kits.engine_kit import inside, make_key, round_trip, wait_jobs, worker_engine

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


def launch_of(pid: int) -> WorkerLaunch:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return WorkerLaunch.decoded(f.read().split(b"\0")[3].decode())  # python -c CODE LAUNCH


def pipes_past_the_limit(engine) -> bool:
    launches = [launch_of(pid) for pid in inside(engine).executor.worker_pids()]
    return all(launch.jobs_fd > 1024 and launch.results_fd > 1024 for launch in launches)


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
        assert inside(engine).executor.deaths() == 0
    finally:
        engine.shutdown()


def test_a_failed_conductor_past_fd_1024_fails_blocks_instead_of_dying(
    tmp_path, take_low_fds, monkeypatch
):
    """The conductor fails (injected) and from then on fails every block it
    is given, waiting for work on its wake eventfd -- numbered past 1024."""

    def broken(self, selector):
        raise RuntimeError("injected conductor failure")

    monkeypatch.setattr(ProcessExecutor, "_serve", broken)
    take_low_fds()
    engine, _primary = worker_engine(str(tmp_path / "kv"), 8)
    try:
        assert inside(engine).executor._wake > 1024
        for job_id in (1, 2):  # the second arrives while it waits on the eventfd
            assert engine.submit_store(job_id, [make_key(job_id)], [job_id])
            job = wait_jobs(engine, [job_id])[job_id]
            assert job.failed == [make_key(job_id)]
        assert engine.counters[Direction.STORE, Failure.ERROR] == 2
    finally:
        engine.shutdown()


def test_the_product_calls_no_select():
    package = REPO / "llmkv_fs"
    calls = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "select"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "select"
            ):
                calls.append(f"{path}:{node.lineno}")
    assert not calls, calls
