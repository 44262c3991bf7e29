"""Issue 20: an I/O worker fills its page tables for the primary region ahead
of the I/O (engine/workers/prefault.py) -- a row before the first block it
moves there, the rest while idle -- and never changes a byte of it.

The page tables are what is tested: /proc/<pid>/pagemap's "present" bit per
page of this process's own mapping, and /proc/<pid>/smaps' Rss of a worker's
mapping of the region. Worker processes only: in thread mode the region is
the engine-core process's own mapping, which no worker maps again.
"""

from __future__ import annotations

import mmap
import os
import struct

import pytest

from llmkv_fs.engine.workers import prefault as prefault_module
from llmkv_fs.engine.workers.prefault import RowPrefault
from tests.kits.engine_kit import BS, inside, round_trip, wait_until, worker_engine

PAGE = mmap.PAGESIZE
ROWS = 8
ROW = 64 * 1024


def present_pages(view: memoryview, first: int, count: int) -> int:
    """How many of the ``count`` pages from page ``first`` of ``view`` have
    a page-table entry in this process (pagemap bit 63)."""
    address = prefault_module.view_address(view) + first * PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // PAGE * 8)
        entries = struct.unpack(f"{count}Q", f.read(8 * count))
    return sum(entry >> 63 for entry in entries)


@pytest.fixture
def fresh_mapping():
    """The region as a worker finds it: a memfd whose pages exist (the owner
    wrote them) mapped afresh here, so no page has an entry yet."""
    fd = os.memfd_create("prefault-test")
    os.ftruncate(fd, ROWS * ROW)
    content = os.urandom(ROWS * ROW)
    os.pwrite(fd, content, 0)
    region = mmap.mmap(fd, ROWS * ROW)
    os.close(fd)
    view = memoryview(region)
    yield view, content
    view.release()
    region.close()


def test_a_row_is_populated_before_its_first_block_and_no_byte_changes(fresh_mapping):
    view, content = fresh_mapping
    pages_per_row = ROW // PAGE
    assert present_pages(view, 0, ROWS * pages_per_row) == 0
    prefault = RowPrefault(view, ROW)

    prefault.before_block(3)
    assert prefault.working
    assert present_pages(view, 3 * pages_per_row, pages_per_row) == pages_per_row
    assert present_pages(view, 0, 3 * pages_per_row) == 0  # only that row
    prefault.before_block(ROWS)  # outside: the block step refuses it, nothing here
    prefault.before_block(-1)
    assert bytes(view) == content


def test_idle_steps_populate_the_rest_and_then_stop(fresh_mapping, monkeypatch):
    view, content = fresh_mapping
    monkeypatch.setattr(prefault_module, "_IDLE_STEP_BYTES", 4 * ROW)
    prefault = RowPrefault(view, ROW)
    prefault.before_block(5)
    steps = 0
    while prefault.idle_work:
        prefault.while_idle()
        steps += 1
        assert steps <= ROWS  # a bounded walk
    assert steps == 3  # rows 0-3, row 4 (row 5 was done), rows 6-7
    assert present_pages(view, 0, ROWS * ROW // PAGE) == ROWS * ROW // PAGE
    assert bytes(view) == content


def test_the_idle_walk_stops_at_its_limit(fresh_mapping, monkeypatch):
    view, _content = fresh_mapping
    monkeypatch.setattr(prefault_module, "IDLE_LIMIT_BYTES", 3 * ROW)
    prefault = RowPrefault(view, ROW)
    while prefault.idle_work:
        prefault.while_idle()
    assert present_pages(view, 0, 3 * ROW // PAGE) == 3 * ROW // PAGE
    assert present_pages(view, 3 * ROW // PAGE, 5 * ROW // PAGE) == 0
    prefault.before_block(6)  # past the limit: still on first use
    assert present_pages(view, 6 * ROW // PAGE, ROW // PAGE) == ROW // PAGE


def test_a_kernel_that_refuses_leaves_the_worker_faulting_as_before(fresh_mapping):
    view, content = fresh_mapping
    prefault = RowPrefault(view, ROW)
    prefault._madvise = lambda _address, _length, _advice: -1  # EINVAL before Linux 5.14
    prefault.before_block(0)
    assert not prefault.working and not prefault.idle_work
    prefault.while_idle()  # nothing, no error
    assert bytes(view) == content


def _region_rss_kib(pid: int, size: int) -> int:
    """Rss of the worker's shared mapping of the region (the one mapping of
    exactly ``size`` bytes of a memfd)."""
    with open(f"/proc/{pid}/smaps", encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        fields = line.split()
        if "-" in fields[0] and "memfd:" in line:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if end - start == size:
                rss = next(entry for entry in lines[i + 1 :] if entry.startswith("Rss:"))
                return int(rss.split()[1])
    raise AssertionError(f"no mapping of {size} bytes in worker {pid}")


def test_idle_workers_map_the_whole_region_and_serve_the_right_bytes(tmp_path):
    n_blocks = 32
    engine, primary = worker_engine(str(tmp_path / "kv"), n_blocks)
    try:
        for pid in inside(engine).executor.worker_pids():
            wait_until(
                lambda pid=pid: _region_rss_kib(pid, n_blocks * BS) * 1024 == n_blocks * BS,
                what=f"worker {pid} to map the whole region while idle",
                deadline_s=60,
            )
        round_trip(engine, primary, n_blocks)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("step_bytes", "steps"), [(ROW // 2, ROWS), (3 * ROW, 3)])
def test_an_idle_step_is_whole_rows_at_least_one(fresh_mapping, monkeypatch, step_bytes, steps):
    """Rows larger than the step still go one per step (never none); smaller
    ones as many as fit."""
    view, _content = fresh_mapping
    monkeypatch.setattr(prefault_module, "_IDLE_STEP_BYTES", step_bytes)
    prefault = RowPrefault(view, ROW)
    taken = 0
    while prefault.idle_work:
        prefault.while_idle()
        taken += 1
    assert taken == steps
    assert present_pages(view, 0, ROWS * ROW // PAGE) == ROWS * ROW // PAGE
