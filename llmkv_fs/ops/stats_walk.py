"""``llmkv-fs stats``' walk of one digest: every file under its rank
directories (and its config directory) tallied by kind -- blocks and bytes
per rank, how recently blocks were used, file sizes, temp files,
quarantined files, NFS silly-renamed files and anything unexpected. Reads
metadata only, never follows a symlink; what cannot be read is counted under
``problems`` and skipped. ``ops/stats.py`` turns the tally into the report.

Threading: ``walk_digest`` runs on the caller's thread. The directories are
listed on ``threads`` threads of ``ops/walker.py``, which hand each listing
back to the caller's thread; every count is made there, so a ``DigestFiles``
is never shared.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import stat

from llmkv_fs.layout.blockfile import last_used
from llmkv_fs.layout.names import in_quarantine, is_block_name, parse_quarantine_name
from llmkv_fs.ops import kinds, scan, walker
from llmkv_fs.ops.problems import Problems
from llmkv_fs.volume.files import file_type

__all__ = ["AGE_BUCKETS", "OTHER_LISTED", "DigestFiles", "walk_digest"]

# Upper bounds (seconds) of the last-used buckets; the last one is open.
AGE_BUCKETS = (("<1h", 3600), ("<1d", 86400), ("<7d", 7 * 86400), ("older", None))
OTHER_LISTED = 100  # unexpected entries listed per digest (all are counted)


def _quarantine_reason(name: str) -> str:
    parsed = parse_quarantine_name(name)
    return parsed.reason if parsed is not None else "unknown"


@dataclasses.dataclass
class DigestFiles:
    """What one walk of a digest's directories found, tallied by kind."""

    ranks: dict[int, dict[str, int]]
    buckets: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    oldest: float | None = None
    newest: float | None = None
    newest_mtime: float | None = None  # the newest block's store (its file's mtime)
    sizes: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    probe: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    # Every block file as (rank directory, path, size): kept only when asked
    # (a sealed namespace's blocks have their trailers read).
    blocks: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    temp_count: int = 0
    temp_bytes: int = 0
    temp_oldest_mtime: float | None = None
    quarantined_count: int = 0
    quarantined_bytes: int = 0
    quarantined_reasons: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter
    )
    other: list[dict[str, str]] = dataclasses.field(default_factory=list)
    other_count: int = 0
    silly_count: int = 0  # NFS .nfs<hex> files: never block data, never use
    silly_bytes: int = 0
    unreadable: list[dict[str, str]] = dataclasses.field(default_factory=list)


def walk_digest(
    d: scan.Digest, now: float, threads: int, problems: Problems, keep_blocks: bool = False
) -> DigestFiles:
    """Tally ``d``'s files; with ``keep_blocks``, list its block files too."""
    found = DigestFiles(ranks={rank: {"blocks": 0, "bytes": 0} for rank in sorted(d.rank_dirs)})
    ranks = found.ranks
    tops: list[tuple[str, str]] = [(d.rank_dirs[r], kinds.RANK_AREA) for r in ranks]
    top_rank = list(ranks)
    if d.has_config_dir:
        tops.append((d.config_dir, kinds.CONFIG_AREA))
    for listing in walker.walk(tops, threads):
        if listing.error is not None:
            found.unreadable.append({"path": listing.path, "detail": str(listing.error)})
            problems.add(listing.error, listing.path, "list")
        for op, path, exc in listing.problems:
            problems.add(exc, path, op)
        top_dir, area = tops[listing.top]
        quarantined_here = area == kinds.RANK_AREA and in_quarantine(top_dir, listing.path)
        for e in listing.files:
            name = os.path.basename(e.path)
            if quarantined_here:  # whatever it is: the tiers or verify put it there
                found.quarantined_count += 1
                found.quarantined_bytes += e.st.st_size
                found.quarantined_reasons[_quarantine_reason(name)] += 1
            elif e.kind == kinds.BLOCK and stat.S_ISREG(e.st.st_mode) and is_block_name(name):
                r = ranks[top_rank[listing.top]]
                r["blocks"] += 1
                r["bytes"] += e.st.st_size
                found.sizes[e.st.st_size] += 1
                if found.sizes[e.st.st_size] <= 3:
                    found.probe.append((e.path, e.st.st_size))
                if keep_blocks:
                    found.blocks.append((top_dir, e.path, e.st.st_size))
                used = last_used(e.st)
                found.oldest = used if found.oldest is None else min(found.oldest, used)
                found.newest = used if found.newest is None else max(found.newest, used)
                if found.newest_mtime is None or e.st.st_mtime > found.newest_mtime:
                    found.newest_mtime = e.st.st_mtime
                age = now - used
                bucket = next(b for b, limit in AGE_BUCKETS if limit is None or age < limit)
                found.buckets[bucket] += 1
            elif e.kind == kinds.TEMP:
                found.temp_count += 1
                found.temp_bytes += e.st.st_size
                if found.temp_oldest_mtime is None or e.st.st_mtime < found.temp_oldest_mtime:
                    found.temp_oldest_mtime = e.st.st_mtime
            elif e.kind == kinds.SILLY_RENAMED:
                found.silly_count += 1
                found.silly_bytes += e.st.st_size
            elif e.kind in (kinds.CONFIG, kinds.LEASE):
                continue
            else:  # OTHER, SYMLINK, and any kind scan may add later
                found.other_count += 1
                if len(found.other) < OTHER_LISTED:
                    found.other.append({"path": e.path, "type": file_type(e.st.st_mode)})
    return found
