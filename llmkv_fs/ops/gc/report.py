"""What a gc pass did (or, with --dry-run, would do): one dict for --json,
a short human summary."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

from llmkv_fs.ops.problems import Problems, shorten
from llmkv_fs.units import format_bytes, format_duration

__all__ = ["Report"]

_LIST_LIMIT = 50


@dataclasses.dataclass
class Report:
    root: str
    dry_run: bool
    host: str
    pid_check: bool
    policy: dict[str, Any]
    started: float = dataclasses.field(default_factory=time.time)
    seconds: float = 0.0
    clock_skew_s: float = 0.0
    scan: dict[str, Any] = dataclasses.field(default_factory=dict)
    digests: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    temps: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"removed": 0, "bytes": 0, "kept": 0}
    )
    capacity: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {
            "volume_bytes": 0,
            "volume_used_bytes": 0,
            "volume_used_percent": 0.0,
            "cache_bytes": 0,
            "need": 0,
            "why": "",
            "evicted_blocks": 0,
            "evicted_bytes": 0,
            "short_bytes": 0,
            "cutoff_idle_s": None,
        }
    )
    dirs_pruned: int = 0
    trash_removed: int = 0
    symlinks: list[str] = dataclasses.field(default_factory=list)
    # Files at lease names that are not usable leases ({"path", "why"}).
    bad_leases: list[dict[str, str]] = dataclasses.field(default_factory=list)
    # Everything that could not be read or done, by kind (ops/problems.py).
    problems: Problems = dataclasses.field(default_factory=Problems)
    # Why the pass stopped before its end (its root could not be read, ...):
    # what it did until then is reported all the same.
    aborted: str = ""
    interrupted: bool = False
    # KV events this pass sent (published, dropped, errors, failures by
    # kind); None when events are off.
    events: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        problems = self.problems
        out = {
            f.name: copy.deepcopy(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name != "problems"  # its own summary, below
        }
        out["symlink_count"] = len(self.symlinks)
        out["symlinks"] = self.symlinks[:_LIST_LIMIT]
        out["bad_lease_count"] = len(self.bad_leases)
        out["bad_leases"] = self.bad_leases[:_LIST_LIMIT]
        out["problems"] = problems.as_dict()
        out["error_count"] = problems.count
        out["errors"] = [p.line() for p in problems.examples()]
        removed = [d for d in self.digests if d["removed"]]
        out["digests_removed"] = len(removed)
        out["bytes_freed"] = (
            sum(d["bytes"] for d in removed)
            + self.temps["bytes"]
            + self.capacity.get("evicted_bytes", 0)
        )
        return out

    def human(self) -> str:
        would = "would remove" if self.dry_run else "removed"
        lines = [
            f"llmkv-fs gc {self.root}" + (" (dry run: nothing changed)" if self.dry_run else "")
        ]
        s = self.scan
        if s:
            lines.append(
                f"scanned {s['digests']} digests: {s['dirs']:,} directories, "
                f"{s['files']:,} files ({format_bytes(s['bytes'])}) in {s['seconds']:.1f}s"
            )
        removed = [d for d in self.digests if d["removed"]]
        kept = [d for d in self.digests if not d["removed"]]
        lines.append(
            f"digests: {would} {len(removed)} "
            f"({format_bytes(sum(d['bytes'] for d in removed))}), kept {len(kept)}"
        )
        for d in (removed + kept)[:_LIST_LIMIT]:
            verb = ("would remove" if self.dry_run else "removed") if d["removed"] else "kept"
            lines.append(f"  {verb:<12} {d['name']}  {format_bytes(d['bytes'])}  ({d['why']})")
        t = self.temps
        lines.append(
            f"temp files: {would} {t['removed']} ({format_bytes(t['bytes'])}), kept {t['kept']}"
        )
        lines += self._capacity_lines()
        lines += self._leftover_lines()
        lines.append(f"errors: {self.problems.count} (could not be read or done; skipped)")
        lines += self.problems.summary_lines()
        if self.aborted:
            lines.append(f"pass stopped early: {self.aborted}")
        lines.append(f"took {self.seconds:.1f}s")
        return "\n".join(lines)

    def _capacity_lines(self) -> list[str]:
        lines = []
        c = self.capacity
        if c.get("need"):
            lines.append(
                f"capacity: {c['why']}: {'would evict' if self.dry_run else 'evicted'} "
                f"{c['evicted_blocks']:,} blocks ({format_bytes(c['evicted_bytes'])}) "
                "least recently used first"
                + (
                    f", the newest of them idle {format_duration(c['cutoff_idle_s'])}"
                    if c.get("cutoff_idle_s") is not None
                    else ""
                )
            )
            if c.get("short_bytes"):
                lines.append(
                    f"  short by {format_bytes(c['short_bytes'])}: every other block was "
                    f"used within --protect {format_duration(self.policy['protect_s'])}"
                )
        elif c["volume_bytes"]:
            lines.append(
                f"capacity: fine (volume {c['volume_used_percent']:.1f}% used, "
                f"cache {format_bytes(c['cache_bytes'])})"
            )
        return lines

    def _leftover_lines(self) -> list[str]:
        """Directories, trash and symlinks; clock skew, an interruption."""
        lines = [
            f"empty directories {'to remove' if self.dry_run else 'removed'}: {self.dirs_pruned}"
        ]
        if self.trash_removed:
            lines.append(
                f"leftovers of an interrupted gc {'to remove' if self.dry_run else 'removed'}"
                f": {self.trash_removed}"
            )
        if self.symlinks:
            lines.append(
                f"symlinks left alone (never followed): {len(self.symlinks)}, "
                f"e.g. {shorten(self.symlinks[0])}"
            )
        if self.bad_leases:
            first = self.bad_leases[0]
            lines.append(
                f"bad lease files skipped (their mtime counts as use): {len(self.bad_leases)}, "
                f"e.g. {first['path']}: {first['why']}"
            )
        if abs(self.clock_skew_s) > 5:
            lines.append(
                f"note: this machine's clock is {self.clock_skew_s:+.0f}s off the "
                "volume's; ages use the volume's clock"
            )
        if self.events is not None:
            e = self.events
            lines.append(
                f"KV events: {e.get('published', 0):,} published, "
                f"{e.get('dropped', 0):,} dropped, {e.get('errors', 0):,} failed"
                + (f", {e['undelivered']:,} not delivered" if e.get("undelivered") else "")
            )
        if self.interrupted:
            lines.append("interrupted (SIGTERM): stopped between two actions")
        return lines
