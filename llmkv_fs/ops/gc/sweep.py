"""One gc pass over a volume, under its lock: scan once, then

1. delete what an interrupted gc left in its trash,
2. remove orphaned digests (re-checking leases right before each),
3. remove temp files of dead writers,
4. evict least-recently-used blocks if capacity asks for it,
5. remove the directories all that left empty.

Every step re-checks before it acts, so a pass is safe against live tiers
writing and loading meanwhile. A pass stopped early (SIGTERM) stops between
two actions; a scan stopped early acts on nothing. An entry that cannot be
read or acted on is reported and skipped; only the root itself failing
(it cannot be listed, or its filesystem statted) ends a pass early, and
even then it reports what it did until then.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from llmkv_fs.ops.gc import actions
from llmkv_fs.ops.gc.inventory import DigestFacts, Inventory, take_inventory
from llmkv_fs.ops.gc.lock import VolumeLock
from llmkv_fs.ops.gc.report import Report
from llmkv_fs.ops.gc.rules import Capacity, Policy, capacity_need, pick_lru, volume_usage
from llmkv_fs.ops.progress import Progress
from llmkv_fs.ops.scan import Digest, RootListing, list_root
from llmkv_fs.volume.fsinfo import filesystem_type

if TYPE_CHECKING:
    from llmkv_fs.ops.events.announcer import Announcer

__all__ = ["gc_pass", "matches"]


def matches(digest: Digest, wanted: Sequence[str]) -> bool:
    """Whether ``digest`` is named by one of ``wanted``: its 12-hex digest,
    its directory name, or its model (``org/name`` or ``org_name``)."""
    for name in wanted:
        if name in (digest.digest, digest.name) or name.replace("/", "_") == digest.model:
            return True
    return False


def gc_pass(
    root: str,
    policy: Policy,
    lock: VolumeLock,
    *,
    keep: Sequence[str] = (),
    models: Sequence[str] = (),
    threads: int = 16,
    dry_run: bool = False,
    progress: Progress | None = None,
    stop: Callable[[], bool] = lambda: False,
    announce: Announcer | None = None,
) -> Report:
    """One pass; with ``announce``, every block file it removes is announced
    (a BlockRemoved) before its unlink (never on a dry run)."""
    started = time.monotonic()
    report = Report(
        root,
        dry_run,
        policy.host,
        policy.pid_check,
        policy={
            "min_age_s": policy.min_age,
            "tmp_age_s": policy.tmp_age,
            "protect_s": policy.protect,
            "max_bytes": policy.max_bytes,
            "high_percent": policy.high,
            "low_percent": policy.low,
            "keep": list(keep),
            "models": list(models),
        },
    )
    sweep = _Sweep(
        root, policy, lock, report, dry_run, progress or Progress("gc", enabled=False), stop
    )
    sweep.announce = None if dry_run else announce
    before = collections.Counter(announce.counts) if announce is not None else None
    try:
        sweep.run(keep, models, threads)
    except OSError as exc:  # the root itself: unreadable, vanished, ...
        report.problems.add(exc, exc.filename or root, "pass")
        report.aborted = f"{exc.filename or root}: {exc.strerror or exc}"
    finally:
        sweep.progress.done()
        if announce is not None and before is not None:
            announce.flush()
            report.events = dict(sorted((announce.counts - before).items()))
    report.seconds = round(time.monotonic() - started, 3)
    return report


class _Sweep:
    """The steps of one pass (the module doc's order) and what they share:
    the volume's clock at the start, the digests removed, the directories
    emptied and the bytes freed so far."""

    def __init__(
        self,
        root: str,
        policy: Policy,
        lock: VolumeLock,
        report: Report,
        dry_run: bool,
        progress: Progress,
        stop: Callable[[], bool],
    ):
        self.root = root
        self.policy = policy
        self.lock = lock
        self.report = report
        self.dry_run = dry_run
        self.progress = progress
        self.stop = stop
        self.now = lock.volume_now()
        report.clock_skew_s = round(time.time() - self.now, 3)
        self.problems = report.problems
        self.freed = 0
        self.gone: set[int] = set()  # indexes (into the selected digests) removed
        self.emptied: set[int] = set()  # directory ids this pass emptied
        # Indexes of digests gc cannot prove are ours: reported, nothing in
        # them touched.
        self.foreign: set[int] = set()
        self.announce: Announcer | None = None

    def run(self, keep: Sequence[str], models: Sequence[str], threads: int) -> None:
        report, root = self.report, self.root
        listing = list_root(root)
        self.problems.extend(listing.problems)
        self.empty_trash(listing)
        facts = [
            DigestFacts(d, selected=not models or matches(d, models), pinned=matches(d, keep))
            for d in listing.digests
        ]
        selected = [f for f in facts if f.selected]
        for f in selected:
            f.read_leases(self.problems)
            f.check_ownership()
            report.bad_leases.extend({"path": b.path, "why": b.why} for b in f.bad_leases)
        inv = self.scan(selected, threads)
        if not inv.complete:
            report.interrupted = True
            return
        cap = volume_usage(root, inv.bytes)  # before this pass frees anything
        self.remove_digests(selected)
        self.remove_temps(inv)
        self.evict(inv, cap)
        self.prune_dirs(inv, len(selected))

    def empty_trash(self, listing: RootListing) -> None:
        report = self.report
        report.symlinks.extend(listing.symlinks)
        for trash in listing.trash:
            if self.dry_run:
                report.trash_removed += 1
                continue
            _removed, complete = actions.delete_tree(trash, self.problems, self.announce)
            report.trash_removed += complete

    def scan(self, selected: list[DigestFacts], threads: int) -> Inventory:
        report, root = self.report, self.root

        def show(inv: Inventory) -> None:
            self.progress.update(
                f"scanning {len(selected)} digests: {inv.dirs:,} directories, {inv.files:,} files"
            )

        inv = take_inventory(root, selected, threads, show, self.stop, self.problems)
        report.symlinks.extend(inv.symlinks)
        report.scan = {
            "digests": len(selected),
            "dirs": inv.dirs,
            "files": inv.files,
            "bytes": inv.bytes,
            "nfs_silly_renamed": inv.silly_renamed,  # left to the NFS client holding them
            "seconds": round(inv.scan_seconds, 3),
            "threads": threads,
            "filesystem": filesystem_type(root),
            "complete": inv.complete,
        }
        return inv

    def remove_digests(self, selected: list[DigestFacts]) -> None:
        report, now = self.report, self.now
        self.foreign = {i for i, f in enumerate(selected) if not f.provably_ours()[0]}
        for index, f in enumerate(selected):
            if self.stop():
                report.interrupted = True
                break
            self.progress.update(f"judging digest {index + 1}/{len(selected)}")
            removed, why = actions.remove_digest(
                f, self.policy, self.lock.volume_now, self.dry_run, self.problems, self.announce
            )
            report.digests.append(
                {
                    "name": f.digest.name,
                    "removed": removed,
                    "why": why,
                    "bytes": f.bytes,
                    "files": f.files,
                    "blocks": f.blocks,
                    "pinned": f.pinned,
                    "leases": len(f.leases),
                    "bad_leases": len(f.bad_leases),
                    "idle_s": round(now - f.newest, 1) if f.newest else None,
                }
            )
            if removed:
                self.freed += f.bytes
                self.gone.add(index)

    def remove_temps(self, inv: Inventory) -> None:
        if self.report.interrupted:
            return
        self.progress.update(f"temp files: {len(inv.temps)}", force=True)
        skip = self.gone | self.foreign
        inv.temps = [t for t in inv.temps if t[2] not in skip]
        removed, temp_bytes, kept = actions.remove_temps(
            inv, self.policy, self.now, self.dry_run, self.emptied, self.problems
        )
        self.report.temps = {"removed": removed, "bytes": temp_bytes, "kept": kept}
        self.freed += temp_bytes

    def evict(self, inv: Inventory, cap: Capacity) -> None:
        report, policy, now = self.report, self.policy, self.now
        need, why = capacity_need(cap, self.freed, policy)
        report.capacity.update(
            volume_bytes=cap.total,
            volume_used_bytes=cap.used,
            volume_used_percent=round(cap.used_percent, 2),
            cache_bytes=cap.cache,
            need=need,
            why=why,
        )
        if need > 0 and not report.interrupted and not self.stop():
            cutoff, blocks, nbytes, _short = pick_lru(inv, need, now, policy.protect, self.gone)
            if cutoff is not None:
                report.capacity["cutoff_idle_s"] = round(now - cutoff, 1)
                if self.dry_run:
                    evicted, evicted_bytes = blocks, nbytes
                else:
                    self.progress.update(f"evicting {blocks:,} blocks", force=True)
                    evicted, evicted_bytes = actions.evict(
                        inv,
                        cutoff,
                        need,
                        now,
                        policy.protect,
                        self.emptied,
                        self.problems,
                        self.stop,
                        self.announce,
                    )
                report.capacity.update(evicted_blocks=evicted, evicted_bytes=evicted_bytes)
            report.capacity["short_bytes"] = max(0, need - report.capacity["evicted_bytes"])
        if self.stop():
            report.interrupted = True

    def prune_dirs(self, inv: Inventory, n_selected: int) -> None:
        if self.report.interrupted:
            return
        self.progress.update("removing empty directories", force=True)
        prunable = set(range(n_selected)) - self.gone - self.foreign
        self.report.dirs_pruned = actions.prune_dirs(
            inv, prunable, self.emptied, self.now, self.policy.protect, self.dry_run, self.problems
        )
