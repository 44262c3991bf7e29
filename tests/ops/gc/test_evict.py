"""Capacity eviction takes blocks in global age order (issue 21): 3,000
blocks older than a burst of 2,000 blocks of one same age, 4,000 to evict.
Afterwards no strictly older block survives while a younger one went, and
which blocks of the burst went is decided the same way every time (by
directory, then name), however the blocks lie in the fan-out directories."""

from __future__ import annotations

import os
import time

import pytest

from tests.kits.gc_kit import DAY, block_bytes, gc, make_digest
from tests.kits.ops_fault_kit import LOCAL_FILESYSTEMS, key_in_dir, local_dir

OLDER, BURST, EVICT = 3000, 2000, 4000
SHARED_DIRS = 100  # the "shared" layout: 30 older and 20 burst blocks in each


@pytest.fixture(params=LOCAL_FILESYSTEMS)
def local_root(request, tmp_path):
    yield from local_dir(request.param, tmp_path)


def spread(directory: int) -> int:
    """Directory numbers far apart, so <hhh> differs too."""
    return (directory * 0x9E3779) % 0x100000


def write_block(layout, k: bytes, used_ns: int) -> str:
    path = layout.block_path(k)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(block_bytes(k))
    os.utime(path, ns=(used_ns, used_ns))  # atime = mtime: its last use
    return path


def allocated(path: str) -> int:
    st = os.lstat(path)
    return st.st_blocks * 512 if st.st_blocks else st.st_size


def allocated_below(*tops: str) -> int:
    return sum(
        allocated(os.path.join(directory, name))
        for top in tops
        for directory, _dirs, files in os.walk(top)
        for name in files
    )


@pytest.mark.parametrize("placement", ["shared-dirs", "own-dirs"])
def test_eviction_is_oldest_first_across_directories_with_ties(local_root, capsys, placement):
    (layout,) = make_digest(local_root, "acme/lru")
    now_ns = time.time_ns()
    burst_ns = now_ns - int(5 * DAY * 1e9)
    older, burst = [], []
    for i in range(OLDER):
        where = i % SHARED_DIRS if placement == "shared-dirs" else i
        used_ns = now_ns - int(10 * DAY * 1e9) - i * 1_000_000_000  # all distinct
        older.append(write_block(layout, key_in_dir(spread(where), f"older-{i}"), used_ns))
    for j in range(BURST):
        where = j % SHARED_DIRS if placement == "shared-dirs" else OLDER + j
        burst.append(write_block(layout, key_in_dir(spread(where), f"burst-{j}"), burst_ns))
    assert len(set(older + burst)) == OLDER + BURST
    per_block = allocated(older[0])
    cache = allocated_below(layout.base_path, layout.rank_dir)
    max_bytes = cache - EVICT * per_block

    status, report = gc(
        local_root, "--high", "off", "--max-bytes", str(max_bytes), "--protect", "0", capsys=capsys
    )
    assert status == 0, report["errors"]
    assert report["capacity"]["evicted_blocks"] == EVICT

    evicted_older = [p for p in older if not os.path.exists(p)]
    evicted_burst = [p for p in burst if not os.path.exists(p)]
    assert len(evicted_older) == OLDER, "strictly older blocks survived a younger one"
    assert len(evicted_burst) == EVICT - OLDER
    # Ties go by directory, then name: the same blocks on every run.
    by_place = sorted(burst, key=lambda p: (os.path.dirname(p), os.path.basename(p)))
    assert sorted(evicted_burst) == sorted(by_place[: EVICT - OLDER])
