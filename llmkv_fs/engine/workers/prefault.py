"""Page-table entries for the primary region in an I/O worker, made before
the I/O needs them.

A worker maps the region afresh (region.map_region), so the first time it
touches a row every 4 KiB page faults, a large share of a load's CPU
(docs/bench/device/issue20_profile.md has the profile). A warm-up pass does
not remove them: each of N workers touches only the rows it was given, so
after one pass a worker still faults on about (N-1)/N of the rows it is
handed next.

``MADV_POPULATE_WRITE`` (Linux 5.14+) fills the entries of a range in one
call, without a trap per page, and changes no byte of the region. Two uses:

* ``before_block``: a row this worker has not touched yet is populated just
  before its I/O (cheaper than trapping on each page);
* ``while_idle``: between jobs, the worker populates the rest of the region
  a few rows at a time, so a long-running worker serves every row without a
  fault. This gives the worker the page tables it would build anyway over
  time as it is handed every row (8 bytes per 4 KiB page: 2 MiB per GiB of
  region per worker), sooner; the idle walk stops at IDLE_LIMIT_BYTES.

Where the kernel refuses (older than 5.14, EINVAL; or anything else) it
stops trying and the worker faults as before: never an error.

Threading: single-threaded, in a worker process.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

from llmkv_fs.engine.workers.region import view_address

__all__ = ["RowPrefault"]

_MADV_POPULATE_WRITE = 23
# Bytes populated per idle step (whole rows: at least one): 8 MiB, ~1-2 ms,
# so a job arriving meanwhile waits at most that long (one row's worth where
# rows are larger).
_IDLE_STEP_BYTES = 8 << 20
# The idle walk covers at most this much of the region (32 MiB of page
# tables per worker); rows past it are populated on first use only.
IDLE_LIMIT_BYTES = 16 << 30


def _libc_madvise() -> Any:
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class RowPrefault:
    """Which rows of ``rows`` this process has populated, and populating the
    others. ``rows`` is the worker's mapping of the region (page-aligned, as
    map_region makes it); ``row_bytes`` the block size."""

    def __init__(self, rows: memoryview, row_bytes: int):
        self._base = view_address(rows)
        self._row_bytes = row_bytes
        self._count = rows.nbytes // row_bytes
        self._done = bytearray(self._count)
        self._cursor = 0  # the idle walk's next row
        self._idle_end = min(self._count, IDLE_LIMIT_BYTES // max(1, row_bytes))
        self._idle_rows = max(1, _IDLE_STEP_BYTES // max(1, row_bytes))
        self._madvise = _libc_madvise()
        self.working = self._count > 0

    def before_block(self, chunk: int) -> None:
        """Populate row ``chunk`` unless done (or out of range: the block
        step refuses that chunk itself)."""
        if self.working and 0 <= chunk < self._count and not self._done[chunk]:
            self._populate(chunk, 1)

    @property
    def idle_work(self) -> bool:
        """Whether ``while_idle`` has rows left to populate."""
        return self.working and self._cursor < self._idle_end

    def while_idle(self) -> None:
        """Populate the next few rows (of the first IDLE_LIMIT_BYTES) not
        done yet."""
        end = self._idle_end
        while self.working and self._cursor < end:
            first = self._cursor
            if self._done[first]:
                self._cursor += 1
                continue
            count = 1
            while count < self._idle_rows and first + count < end and not self._done[first + count]:
                count += 1
            self._populate(first, count)
            self._cursor = first + count
            return

    def _populate(self, first: int, count: int) -> None:
        start = self._base + first * self._row_bytes
        aligned = start - start % mmap.PAGESIZE  # rows need not start on a page
        length = start + count * self._row_bytes - aligned
        if self._madvise(aligned, length, _MADV_POPULATE_WRITE):
            self.working = False  # refused: fault as before
            return
        self._done[first : first + count] = b"\x01" * count
