"""``io_workers_nice``: worker processes (and every thread they start) run
that much nicer than the engine-core process and still move every byte; I/O
threads keep the engine's priority, since they share vLLM's GIL with the
scheduler (docs/configuration.md). Both io modes, each asserting its rule."""

from __future__ import annotations

import logging
import os
import re
import threading

import pytest
import xxhash

from llmkv_fs.engine.block.hash_path import xxh3_path_for

from engine_kit import round_trip, wait_until

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
    assert len(started) == 1 and f"xxh3 of python-xxhash {xxhash.VERSION}: " in started[0]
    round_trip(engine, primary, 8)
    if engines.mode.workers:
        assert f"4 worker processes (nice +{NICER_BY})" in started[0]
        pids = engine.executor.worker_pids()
        assert len(pids) == 4

        def all_nicer() -> bool:
            return all(set(thread_nices(pid).values()) == {wanted} for pid in pids)

        wait_until(all_nicer, f"every thread of every worker at nice {wanted}")
        assert os.getpriority(os.PRIO_PROCESS, 0) == base, "the engine's own priority moved"
    else:
        io_threads = [t for t in threading.enumerate() if re.fullmatch(r"llmkv_fs_[rw]\d+", t.name)]
        assert len(io_threads) == 4
        assert {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in io_threads} == {base}
    round_trip(engine, primary, 8)  # and at that priority every byte still comes back


X86_AVX512 = frozenset({"sse2", "avx2", "avx512f"})


@pytest.mark.parametrize(
    "machine,flags,version,path",
    [
        ("x86_64", X86_AVX512, "4.1.0", "avx512"),
        ("x86_64", frozenset({"sse2", "avx2"}), "4.1.0", "avx2"),
        ("x86_64", frozenset({"sse2"}), "4.2", "sse2"),
        ("x86_64", X86_AVX512, "4.0.1", "sse2-only"),
        ("x86_64", X86_AVX512, "3.6.0", "sse2-only"),
        ("x86_64", X86_AVX512, "dev", "sse2-only"),
        ("aarch64", frozenset({"asimd"}), "4.1.0", "aarch64-build"),
    ],
)
def test_the_start_up_line_says_which_xxh3_runs(machine, flags, version, path):
    assert xxh3_path_for(machine, flags, version) == path
