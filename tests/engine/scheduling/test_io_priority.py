"""``io_workers_nice``: worker processes (and every thread they start) run
that much nicer than the engine-core process and still move every byte; I/O
threads keep the engine's priority, since they share vLLM's GIL with the
scheduler (docs/configuration.md). Both io modes, each asserting its rule."""

from __future__ import annotations

import logging
import os
import re
import threading

import xxhash

from llmkv_fs.engine import xxh3_path
from tests.kits.engine_kit import inside, round_trip, wait_until

NICER_BY = 7


def thread_nices(pid: int) -> dict[int, int]:
    """nice value of every thread of ``pid`` (Linux: nice is per thread)."""
    nices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            nices[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
        except ProcessLookupError:  # a thread that just ended
            pass
    return nices


def test_io_workers_nice_lowers_worker_processes_and_spares_io_threads(engines, tmp_path, caplog):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    wanted = min(19, base + NICER_BY)
    with caplog.at_level(logging.INFO, logger="vllm.llmkv_fs"):
        engine, _, primary = engines(str(tmp_path / "root"), io_workers_nice=NICER_BY)
    started = [r.getMessage() for r in caplog.records if "llmkv_fs engine: " in r.getMessage()]
    assert len(started) == 1
    assert f"(xxh3 of python-xxhash {xxhash.VERSION}: {xxh3_path()})" in started[0]
    round_trip(engine, primary, 8)
    if engines.mode.workers:
        assert f"4 worker processes (nice +{NICER_BY})" in started[0]
        pids = inside(engine).executor.worker_pids()
        assert len(pids) == 4

        def all_nicer() -> bool:
            return all(set(thread_nices(pid).values()) == {wanted} for pid in pids)

        wait_until(all_nicer, f"every thread of every worker at nice {wanted}")
        assert os.getpriority(os.PRIO_PROCESS, 0) == base, "the engine's own priority moved"
    else:
        assert "io_workers_nice applies to worker processes only: not used" in started[0]
        io_threads = [t for t in threading.enumerate() if re.fullmatch(r"llmkv_fs_[rw]\d+", t.name)]
        assert len(io_threads) == 4
        assert {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in io_threads} == {base}
    round_trip(engine, primary, 8)  # and at that priority every byte still comes back
