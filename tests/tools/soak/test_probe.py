"""The soak's growth rule (tools/soak/probe.py): a thread or descriptor more
after warm-up is a leak, except what a busy machine alone can cause -- the
lookup pool starting a thread, a thread opening its root descriptor on its
first block after warm-up (CI saw both) -- which are bounded instead."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from tools.soak.probe import Snapshot, growth_problems, open_fds

WARM = Snapshot(
    jobs=10_000,
    rss=100 << 20,
    fds=20,
    threads=8,
    children=2,
    children_rss=80 << 20,
    children_fds=24,
    none_refs=50_000,
    lookup_pool_threads=0,
    dir_fds=4,
    children_dir_fds=1,
    children_threads=4,
)


def test_a_thread_or_a_descriptor_more_is_a_leak():
    end = dataclasses.replace(WARM, jobs=100_000, fds=21, threads=9, children_fds=25)
    assert growth_problems(WARM, end) == [
        "open fds grew from 20 to 21",
        "threads grew from 8 to 9",
        "children's open fds grew from 24 to 25",
    ]


def test_the_lookup_pool_may_start_threads():
    end = dataclasses.replace(WARM, jobs=100_000, threads=10, lookup_pool_threads=2)
    assert growth_problems(WARM, end) == []
    leaked = dataclasses.replace(end, threads=11)
    assert growth_problems(WARM, leaked) == ["threads grew from 8 to 9"]


def test_open_directories_are_bounded_by_threads_and_roots():
    # A thread's root descriptor, opened on its first block after warm-up.
    end = dataclasses.replace(WARM, jobs=100_000, dir_fds=8, children_dir_fds=4)
    assert growth_problems(WARM, end) == []
    assert growth_problems(WARM, dataclasses.replace(end, dir_fds=16), roots=2) == []
    leaked = dataclasses.replace(end, dir_fds=9, children_dir_fds=5)
    assert growth_problems(WARM, leaked) == [
        "open directories: 9, more than one per thread and root (8)",
        "children's open directories: 5, more than one per thread and root (4)",
    ]


def _held_child(pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[str]:
    """A child that holds still, with only its standard streams and ``pass_fds``
    open: counting our own process races whatever its other threads open."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=pass_fds,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


def _fds_of(pass_fds: tuple[int, ...] = ()) -> tuple[int, int]:
    child = _held_child(pass_fds)
    try:
        return open_fds(child.pid)
    finally:
        child.communicate("")


def test_directories_are_counted_apart_from_other_descriptors(tmp_path):
    others, dirs = _fds_of()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert _fds_of((fd,)) == (others, dirs + 1)
    finally:
        os.close(fd)
    with open(tmp_path / "f", "w") as f:
        assert _fds_of((f.fileno(),)) == (others + 1, dirs)
