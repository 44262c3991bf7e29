"""The house's walk of one block (tools/trace_block.py), held as a test: a
store of one block in I/O threads crosses at most 12 product files and
enters none it has left again but the scheduler's publish; worker processes
add at most 3 files; a lookup never calls back up into the owner's module.
Traced on the Python byte path (compiled_io off), the longer of the two (the compiled one runs
a subset of its files)."""

from __future__ import annotations

import pytest

from llmkv_fs.engine.block.bytes_c import byte_path_line
from tools import trace_block

PUBLISH = "llmkv_fs/engine/scheduling/scheduler.py:slice_done"


@pytest.fixture
def traced(tmp_path):
    return {
        mode: trace_block.trace(mode, 64 << 10, str(tmp_path / mode), compiled=False)
        for mode in ("threads", "workers")
    }


def test_one_block_crosses_each_file_once(traced):
    threads, workers = traced["threads"], traced["workers"]
    for op in ("store", "load"):
        walk = threads[op]
        assert [r["into"] for r in walk["reentries"]] == [PUBLISH], (op, walk["reentries"])
        assert walk["owner_module_upcalls"] == [], op
        in_workers = len(workers[op]["files_in_all"])
        assert in_workers <= walk["n_files"] + 3, (op, workers[op]["files_in_all"])
        # The worker's own walk returns only to write its results back.
        assert [r["into"] for r in workers[op]["worker"]["reentries"]] == [
            "llmkv_fs/engine/workers/records.py:encode_result"
        ], op
    assert threads["store"]["n_files"] <= 12, threads["store"]["files"]
    for mode in ("threads", "workers"):
        lookup = traced[mode]["lookup"]
        assert lookup["owner_module_upcalls"] == [] and lookup["n_reentries"] == 0, lookup
        assert lookup["verdict"] is True


def test_worker_processes_run_the_compiled_byte_path(tmp_path):
    """Where it is built, a worker process stores and loads through the
    compiled call, as an I/O thread does (its walk enters bytes_c.py, and
    not the Python path's contents.py)."""
    if byte_path_line([]).startswith("python"):
        pytest.skip(f"the compiled byte path does not run here: {byte_path_line([])}")
    traced = trace_block.trace("workers", 64 << 10, str(tmp_path / "kv"))
    for op in ("store", "load"):
        files = traced[op]["worker"]["files"]
        assert "llmkv_fs/engine/block/bytes_c.py" in files, (op, files)
        assert "llmkv_fs/engine/block/contents.py" not in files, (op, files)
