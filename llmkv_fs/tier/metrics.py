"""Our Prometheus metrics, declared for and emitted through vLLM's own
offloading metrics path (``build_metric_definitions`` in every process that
renders metrics, ``get_stats`` in the engine core).

Every name emitted must be declared: vLLM's Prometheus logger in the API
server raises on an undeclared one. ``METRICS`` is therefore the single
table both sides read, and the engine's typed counter keys map onto it
through ``counter_series``.

Threading: ``TierMetrics.take_stats`` runs under vLLM's manager lock (the
scheduler side), like every other tier call; it reads engine counters that
only the same owner updates.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

try:
    from vllm.v1.kv_offload.tiering.base import TIER_LABEL
except ImportError:  # vLLM 0.32 spells the label inline in its tiering spec
    TIER_LABEL = "tier"

from llmkv_fs.engine import (
    CounterKey,
    Direction,
    FsEngine,
    LookupAnswer,
    MissReason,
    Outcome,
    Tally,
)
from llmkv_fs.layout.blockfile import Corruption

PREFIX = "vllm:kv_offload_llmkv_fs_"
_JOB_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter, gauge, histogram
    doc: str
    labels: tuple[str, ...] = ()  # besides the tier label

    @property
    def labelnames(self) -> tuple[str, ...]:
        return (TIER_LABEL, *self.labels)

    def metadata(self) -> OffloadingMetricMetadata:
        if self.kind == "counter":
            return OffloadingCounterMetadata(documentation=self.doc, labelnames=self.labelnames)
        if self.kind == "gauge":
            return OffloadingGaugeMetadata(documentation=self.doc, labelnames=self.labelnames)
        return OffloadingHistogramMetadata(
            documentation=self.doc, labelnames=self.labelnames, buckets=_JOB_SECONDS_BUCKETS
        )


def _m(suffix: str, kind: str, doc: str, *labels: str) -> Metric:
    return Metric(PREFIX + suffix, kind, doc, labels)


METRICS = {
    m.name: m
    for m in (
        _m("written_bytes", "counter", "Bytes written to block files."),
        _m("read_bytes", "counter", "Bytes read from block files into the CPU tier."),
        _m(
            "stored_blocks",
            "counter",
            "Blocks stored, by outcome: written (a new file), present (a block "
            "file this replica would load was already there), replaced (a file it "
            "would never load was written over).",
            "outcome",
        ),
        _m(
            "loaded_blocks",
            "counter",
            "Blocks loaded into the CPU tier, by verification: verified (trailer and "
            "checksum) or unverified (no checksum checked: a trailer-less file of "
            "vLLM's built-in tier, a block written with checksum off, or this reader "
            "has checksum off).",
            "verification",
        ),
        _m(
            "store_failures",
            "counter",
            "Store blocks not published, by reason: queue_full, space (space guard or "
            "ENOSPC), stalled, volume_failed, link_in_tree (a symlinked directory on "
            "the block's path, never followed), deadline, error, worker_died, cancelled.",
            "reason",
        ),
        _m(
            "load_failures",
            "counter",
            "Load blocks not delivered, by reason: missing, corrupt, no_checksum, "
            "skipped (an earlier block of the job failed), link_in_tree, deadline, "
            "stalled, volume_failed, error, worker_died, cancelled, foreign_key (a "
            "sealed block of a key this replica does not hold, left in place).",
            "reason",
        ),
        _m(
            "corrupt_blocks",
            "counter",
            "Block files refused on load, by what was wrong (the quarantine file "
            "names and llmkv-fs verify use the same words): " + ", ".join(Corruption) + ".",
            "reason",
        ),
        _m("quarantined_files", "counter", "Bad block files moved to .quarantine/."),
        _m("deadline_expiries", "counter", "Blocks failed because their job passed job_timeout_s."),
        _m(
            "lookups",
            "counter",
            "Per-chunk lookups answered, by result: hit, miss, retry (check pending), "
            "deadline_miss (a pending check answered miss after the deadline).",
            "result",
        ),
        _m(
            "lookup_misses",
            "counter",
            'Lookups answered miss, by why (they sum to lookups{result="miss"}): '
            "not_on_volume (a check found no file), lost_root (the key's root is "
            "lost), stalled (the volume is not answering), deadline (the lookup "
            "deadline answered first), check_failed (the check failed: EIO, a root "
            "lost meanwhile), remembered_bad (a file whose load failed and would fail "
            "again), foreign_key (sealed with a key this replica does not hold), "
            "load_failed (its load failed: corrupt, gone, ...).",
            "reason",
        ),
        _m("store_job_seconds", "histogram", "Store job latency, submit to result, seconds."),
        _m("load_job_seconds", "histogram", "Load job latency, submit to result, seconds."),
        _m(
            "queued_blocks",
            "gauge",
            "Blocks waiting for an I/O place (not handed out yet), by direction.",
            "direction",
        ),
        _m(
            "busy_places",
            "gauge",
            "I/O places holding blocks: an I/O thread moving a slice of blocks, or one "
            "of a worker process's two places (one slice running, one waiting in its "
            "pipe). At most io_places; equal to it, the tier is saturated.",
        ),
        _m(
            "io_places",
            "gauge",
            "I/O places the tier has: n_read_threads + n_write_threads threads, or two "
            "per worker process (io_workers).",
        ),
        _m(
            "held_blocks",
            "gauge",
            "Blocks handed to I/O places and not given back yet (a place holds a slice: "
            "consecutive blocks of one job, up to 16 and about 1 MiB).",
        ),
        _m(
            "io_workers",
            "gauge",
            "I/O worker processes running (io_workers); 0 when the I/O runs on threads.",
        ),
        _m(
            "io_worker_deaths",
            "counter",
            "I/O worker processes that died (crashed or killed) and were replaced; "
            "their in-flight blocks failed with reason error.",
        ),
        _m(
            "stuck_blocks",
            "gauge",
            "Blocks still inside a syscall after their job's deadline (volume stalled).",
        ),
        _m(
            "space_guard_tripped",
            "gauge",
            "1 while the space guard refuses stores to this root.",
            "root",
        ),
        _m(
            "volume_failed",
            "gauge",
            "1 while the root is missing or not the directory the tier started on "
            "(volume unmounted): its blocks' stores and loads fail, lookups of them "
            "miss (with one root: every job is refused).",
            "root",
        ),
        _m("volume_used_bytes", "gauge", "Used bytes of the root's volume (statvfs).", "root"),
        _m(
            "volume_free_bytes",
            "gauge",
            "Bytes available on the root's volume (statvfs, sampled).",
            "root",
        ),
        _m(
            "root_blocks",
            "counter",
            "Blocks of finished jobs by the root they are placed on (how "
            "path_sharding spreads the work, and which root fails), direction and "
            "result: ok, failed.",
            "root",
            "direction",
            "result",
        ),
    )
}

# Engine counter key -> the series it feeds. Every key type is handled in
# counter_series, and every member has a series (tests/tier/test_metrics.py walks
# all_counter_keys): a new enum member needs no edit here unless it is a Tally.
_SUCCESSES = {Direction.STORE: "stored_blocks", Direction.LOAD: "loaded_blocks"}
_FAILURES = {Direction.STORE: "store_failures", Direction.LOAD: "load_failures"}
_TALLIES = {
    Tally.BYTES_WRITTEN: "written_bytes",
    Tally.BYTES_READ: "read_bytes",
    Tally.QUARANTINED: "quarantined_files",
    Tally.DEADLINE_EXPIRED: "deadline_expiries",
    Tally.WORKER_DEATHS: "io_worker_deaths",
}
_JOB_SECONDS = {Direction.STORE: "store_job_seconds", Direction.LOAD: "load_job_seconds"}

_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "busy_places": ("busy_places", ()),
    "io_places": ("io_places", ()),
    "held_blocks": ("held_blocks", ()),
    "io_workers": ("io_workers", ()),
    "stuck_blocks": ("stuck_blocks", ()),
    "queued_store_blocks": ("queued_blocks", ("store",)),
    "queued_load_blocks": ("queued_blocks", ("load",)),
}


def counter_series(key: CounterKey) -> tuple[str, tuple[str, ...]]:
    """Engine counter key -> (metric name, label values besides the tier)."""
    if isinstance(key, Outcome):
        return PREFIX + _SUCCESSES[key.direction], (key.value,)
    if isinstance(key, Corruption):
        return PREFIX + "corrupt_blocks", (key.value,)
    if isinstance(key, LookupAnswer):
        return PREFIX + "lookups", (key.value,)
    if isinstance(key, MissReason):
        return PREFIX + "lookup_misses", (key.value,)
    if isinstance(key, Tally):
        return PREFIX + _TALLIES[key], ()
    direction, reason = key
    return PREFIX + _FAILURES[direction], (reason.value,)


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {name: metric.metadata() for name, metric in METRICS.items()}


_K = TypeVar("_K")


class TierMetrics:
    """Turns an engine's cumulative counters, latency lists and gauges into
    one OffloadingConnectorStats per ``take_stats`` call (deltas since the
    previous call), labelled with this tier's label."""

    def __init__(self, engine: FsEngine, tier_label: str):
        self._engine = engine
        self._label = tier_label
        self._reported: collections.Counter[CounterKey] = collections.Counter()
        self._reported_by_root: collections.Counter[tuple[int, Direction, bool]] = (
            collections.Counter()
        )

    def take_stats(self) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        engine = self._engine
        self._increase(stats, engine.counters, self._reported, counter_series)
        self._increase(stats, engine.root_counters, self._reported_by_root, self._root_series)
        for direction in list(engine.job_latencies):
            taken, engine.job_latencies[direction] = engine.job_latencies[direction], []
            for seconds in taken:
                stats.observe_histogram(PREFIX + _JOB_SECONDS[direction], seconds, (self._label,))
        for gauge, value in engine.gauges().items():
            suffix, gauge_labels = _GAUGES[gauge]
            stats.set_gauge(PREFIX + suffix, value, (self._label, *gauge_labels))
        for root, gauges in engine.root_gauges().items():
            for gauge, value in gauges.items():  # named as their metric
                stats.set_gauge(PREFIX + gauge, value, (self._label, root))
        return stats

    def _increase(
        self,
        stats: OffloadingConnectorStats,
        totals: Mapping[_K, int],
        reported: collections.Counter[_K],
        series: Callable[[_K], tuple[str, tuple[str, ...]]],
    ) -> None:
        """Each cumulative total's growth since the last call, as a counter
        increase of its series."""
        for key, total in list(totals.items()):
            delta = total - reported[key]
            if delta:
                reported[key] = total
                name, labels = series(key)
                stats.increase_counter(name, delta, (self._label, *labels))

    def _root_series(self, key: tuple[int, Direction, bool]) -> tuple[str, tuple[str, ...]]:
        index, direction, ok = key
        root = self._engine.roots[index].root_dir
        return PREFIX + "root_blocks", (root, direction.value, "ok" if ok else "failed")
