"""What a soak measures about the process it runs in, and the growth it allows.

A ``Snapshot`` is taken at a quiescent point (no transfer in flight, no
request open), so what it counts is what the process keeps, not what a job
in progress holds: resident memory, open fds and threads of this process,
and the same for its children (the tier's worker processes with
``io_workers`` > 0). Descriptors of directories are counted apart: at a
quiescent point the tier holds only its roots open, one descriptor per
thread that has touched a root (llmkv_fs/volume/beneath.py), opened on that
thread's first block -- which thread gets its first block after warm-up is
the scheduler's and the machine's choice (CI: one more, 24 to 25), so they
are bounded by threads x roots instead of held flat.

``none_refs`` is ``sys.getrefcount(None)``: vLLM 0.33.0's built-in fs tier
returns None from its C extension without taking a reference, so it falls
by one a job until the interpreter aborts (``Fatal Python error:
none_dealloc``, Python 3.10/3.11).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
import threading

import psutil

MiB = 1 << 20

# RSS growth allowed between the warm snapshot and the end, per process. What
# the tier keeps per key is bounded at 65,536 entries per process that moves
# blocks (the owner with threads, each worker with io_workers > 0): the
# access-stamp memory, ~240 bytes a loaded path (~15 MiB full), and the known
# fan-out directories, ~135 bytes each (~8.5 MiB) -- tracemalloc of this
# soak's 134-character paths; the remembered misses fill only on failed
# loads (none here). 32 MiB is those ~24 MiB plus allocator slack. Measured
# over 180,000 jobs after warm-up (tools/soak/run.py): 20 MiB with threads, 26 MiB
# for two workers together, flat after the caches first filled.
RSS_GROWTH_BOUND = 32 * MiB
# None's count moves with what happens to hold None at a quiescent point (a
# few, measured flat over 200,000 jobs); the built-in loses one a job.
NONE_REFS_SLACK = 1000
# The lookup's stat pool (llmkv_fs/engine/lookup.py) is the one pool that may
# start a thread after warm-up without leaking: it starts one only for a
# batch whose first checks waited on the volume, which on tmpfs happens only
# when the machine is busy enough to stall them (CI, a loaded 2-core guest:
# one thread more at the end). It is bounded by ``lookup_threads``. Its
# threads are named ``<name>_stat_<i>``.
LOOKUP_POOL_MARK = "_stat_"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    jobs: int
    rss: int
    fds: int
    threads: int
    children: int
    children_rss: int
    children_fds: int
    none_refs: int
    lookup_pool_threads: int = 0  # of ``threads``: the lookup's stat pool
    dir_fds: int = 0  # directories open (not in ``fds``): root descriptors
    children_dir_fds: int = 0
    children_threads: int = 0

    def brief(self) -> str:
        text = (
            f"jobs {self.jobs:,}: RSS {self.rss / MiB:.1f} MiB, {self.fds} fds, "
            f"{self.threads} threads"
        )
        if self.children:
            text += (
                f"; {self.children} children: RSS {self.children_rss / MiB:.1f} MiB, "
                f"{self.children_fds} fds"
            )
        return f"{text}; None refs {self.none_refs:,}"


def open_fds(pid: int) -> tuple[int, int]:
    """(descriptors that are not directories, directories) open in ``pid``."""
    others = dirs = 0
    base = f"/proc/{pid}/fd"
    for name in os.listdir(base):
        try:
            is_dir = stat.S_ISDIR(os.stat(f"{base}/{name}").st_mode)
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        dirs += is_dir
        others += not is_dir
    return others, dirs


def snapshot(jobs: int) -> Snapshot:
    me = psutil.Process()
    rss = fds = dir_fds = threads = alive = 0
    for child in me.children(recursive=True):
        try:
            rss += child.memory_info().rss
            child_fds, child_dirs = open_fds(child.pid)
            threads += child.num_threads()
        except (psutil.NoSuchProcess, FileNotFoundError):  # gone between listing and asking
            continue
        fds, dir_fds, alive = fds + child_fds, dir_fds + child_dirs, alive + 1
    my_fds, my_dirs = open_fds(os.getpid())
    return Snapshot(
        jobs=jobs,
        rss=me.memory_info().rss,
        fds=my_fds,
        threads=me.num_threads(),
        children=alive,
        children_rss=rss,
        children_fds=fds,
        none_refs=sys.getrefcount(None),
        lookup_pool_threads=sum(LOOKUP_POOL_MARK in t.name for t in threading.enumerate()),
        dir_fds=my_dirs,
        children_dir_fds=dir_fds,
        children_threads=threads,
    )


def growth_problems(
    warm: Snapshot, end: Snapshot, rss_bound: int = RSS_GROWTH_BOUND, roots: int = 1
) -> list[str]:
    """What grew beyond the bounds between two quiescent snapshots: fds
    (directories apart), threads (but for the lookup pool's, see
    ``LOOKUP_POOL_MARK``) and worker processes not at all; open directories
    at most one per thread and root (``roots``); RSS by at most
    ``rss_bound`` (per process: the children's allowance is one bound per
    child)."""
    problems = []
    pool_started = max(0, end.lookup_pool_threads - warm.lookup_pool_threads)
    flat = [
        ("open fds", warm.fds, end.fds),
        ("threads", warm.threads, end.threads - pool_started),
        ("child processes", warm.children, end.children),
        ("children's open fds", warm.children_fds, end.children_fds),
    ]
    for what, before, after in flat:
        if after > before:
            problems.append(f"{what} grew from {before} to {after}")
    bounded = [
        ("open directories", end.dir_fds, end.threads * roots),
        ("children's open directories", end.children_dir_fds, end.children_threads * roots),
    ]
    for what, count, bound in bounded:
        if count > bound:
            problems.append(f"{what}: {count}, more than one per thread and root ({bound})")
    rss = [
        ("RSS", warm.rss, end.rss, rss_bound),
        ("children's RSS", warm.children_rss, end.children_rss, rss_bound * warm.children),
    ]
    for what, before, after, bound in rss:
        if after - before > bound:
            problems.append(
                f"{what} grew by {(after - before) / MiB:.1f} MiB "
                f"(from {before / MiB:.1f}; bound {bound / MiB:.0f} MiB)"
            )
    # The built-in loses one reference a job. Live references to None in our
    # own data (a job's outcome slots start as None, cache entries, frames)
    # differ between two snapshots by thousands under load (3,527 seen over
    # 90,000 jobs with two busy loops beside the run): a quarter of the jobs
    # run between the snapshots tells the two apart.
    slack = max(NONE_REFS_SLACK, (end.jobs - warm.jobs) // 4)
    if warm.none_refs - end.none_refs > slack:
        problems.append(
            f"None's reference count fell by {warm.none_refs - end.none_refs:,} "
            "(a C extension returning None without a reference)"
        )
    return problems
