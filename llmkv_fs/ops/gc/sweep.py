"""One gc pass over a volume, under its lock: scan once, then

1. delete what an interrupted gc left in its trash,
2. remove orphaned digests (re-checking leases right before each),
3. remove temp files of dead writers,
4. evict least-recently-used blocks if capacity asks for it,
5. remove the directories all that left empty.

Every step re-checks before it acts, so a pass is safe against live tiers
writing and loading meanwhile. A pass stopped early (SIGTERM) stops between
two actions; a scan stopped early acts on nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from llmkv_fs.ops.gc import actions
from llmkv_fs.ops.gc.inventory import DigestFacts, Inventory, take_inventory
from llmkv_fs.ops.gc.lock import VolumeLock
from llmkv_fs.ops.gc.report import Progress, Report
from llmkv_fs.ops.gc.rules import Policy, capacity_need, pick_lru, volume_usage
from llmkv_fs.ops.scan import Digest, filesystem_type, list_root

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
) -> Report:
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
    now = lock.volume_now()
    report.clock_skew_s = round(time.time() - now, 3)
    errors = report.errors
    progress = progress or Progress(enabled=False)

    listing = list_root(root)
    report.symlinks.extend(listing.symlinks)
    for trash in listing.trash:
        if dry_run:
            report.trash_removed += 1
            continue
        _removed, complete = actions.delete_tree(trash, errors)
        report.trash_removed += complete

    facts = [
        DigestFacts(d, selected=not models or matches(d, models), pinned=matches(d, keep))
        for d in listing.digests
    ]
    selected = [f for f in facts if f.selected]
    for f in selected:
        f.leases = f.digest.leases()

    def show(inv: Inventory) -> None:
        progress.update(
            f"scanning {len(selected)} digests: {inv.dirs:,} directories, {inv.files:,} files"
        )

    inv = take_inventory(root, selected, threads, show, stop)
    report.symlinks.extend(inv.symlinks)
    errors.extend(inv.errors)
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
    if not inv.complete:
        progress.done()
        report.interrupted = True
        report.seconds = round(time.monotonic() - started, 3)
        return report
    cap = volume_usage(root, inv.bytes)

    freed = 0
    gone: set[int] = set()
    for index, f in enumerate(selected):
        if stop():
            report.interrupted = True
            break
        progress.update(f"judging digest {index + 1}/{len(selected)}")
        removed, why = actions.remove_digest(f, policy, lock.volume_now, dry_run, errors)
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
                "idle_s": round(now - f.newest, 1) if f.newest else None,
            }
        )
        if removed:
            freed += f.bytes
            gone.add(index)

    emptied: set[int] = set()
    if not report.interrupted:
        progress.update(f"temp files: {len(inv.temps)}", force=True)
        inv.temps = [t for t in inv.temps if t[2] not in gone]
        removed, temp_bytes, kept = actions.remove_temps(inv, policy, now, dry_run, emptied, errors)
        report.temps = {"removed": removed, "bytes": temp_bytes, "kept": kept}
        freed += temp_bytes

    need, why = capacity_need(cap, freed, policy)
    report.capacity.update(
        volume_bytes=cap.total,
        volume_used_bytes=cap.used,
        volume_used_percent=round(cap.used_percent, 2),
        cache_bytes=cap.cache,
        need=need,
        why=why,
    )
    if need > 0 and not report.interrupted and not stop():
        cutoff, blocks, nbytes, _short = pick_lru(inv, need, now, policy.protect, gone)
        if cutoff is not None:
            report.capacity["cutoff_idle_s"] = round(now - cutoff, 1)
            if dry_run:
                evicted, evicted_bytes = blocks, nbytes
            else:
                progress.update(f"evicting {blocks:,} blocks", force=True)
                evicted, evicted_bytes = actions.evict(
                    inv, cutoff, need, now, policy.protect, emptied, errors, stop
                )
            report.capacity.update(evicted_blocks=evicted, evicted_bytes=evicted_bytes)
        report.capacity["short_bytes"] = max(0, need - report.capacity["evicted_bytes"])
    if stop():
        report.interrupted = True

    if not report.interrupted:
        progress.update("removing empty directories", force=True)
        prunable = set(range(len(selected))) - gone
        report.dirs_pruned = actions.prune_dirs(
            inv, prunable, emptied, now, policy.protect, dry_run, errors
        )
    progress.done()
    report.seconds = round(time.monotonic() - started, 3)
    return report
