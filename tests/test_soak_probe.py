"""The soak's growth rule (tools/soak/probe.py): a thread or descriptor more
after warm-up is a leak, except the lookup pool starting a thread, which a
busy machine alone can cause (CI saw it: one thread and its root descriptor)."""

from __future__ import annotations

import dataclasses

from tools.soak.probe import Snapshot, growth_problems

WARM = Snapshot(
    jobs=10_000,
    rss=100 << 20,
    fds=26,
    threads=8,
    children=0,
    children_rss=0,
    children_fds=0,
    none_refs=50_000,
    lookup_pool_threads=0,
)


def test_a_thread_and_a_descriptor_more_are_a_leak():
    end = dataclasses.replace(WARM, jobs=100_000, fds=27, threads=9)
    assert growth_problems(WARM, end) == [
        "open fds grew from 26 to 27",
        "threads grew from 8 to 9",
    ]


def test_the_lookup_pool_may_start_threads_each_with_a_descriptor_per_root():
    end = dataclasses.replace(WARM, jobs=100_000, fds=30, threads=10, lookup_pool_threads=2)
    assert growth_problems(WARM, end, roots=2) == []
    # Beyond what the pool's new threads hold, growth is still a leak.
    leaked = dataclasses.replace(end, fds=31, threads=11)
    assert growth_problems(WARM, leaked, roots=2) == [
        "open fds grew from 26 to 27",
        "threads grew from 8 to 9",
    ]
