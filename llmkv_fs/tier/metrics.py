"""Our Prometheus metrics, declared for and emitted through vLLM's own
offloading metrics path (``build_metric_definitions`` in every process that
renders metrics, ``get_stats`` in the engine core).

Every name emitted must be declared: vLLM's Prometheus logger in the API
server raises on an undeclared one. ``METRICS`` is therefore the single
table both sides read, and the engine's counter names map onto it through
``_counter_target``.

Threading: ``TierMetrics.take_stats`` runs under vLLM's manager lock (the
scheduler side), like every other tier call; it reads engine counters that
only the same owner updates.
"""

from __future__ import annotations

import collections
import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)
from vllm.v1.kv_offload.tiering.base import TIER_LABEL

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
    m.name: m for m in (
        _m("written_bytes", "counter", "Bytes written to block files."),
        _m("read_bytes", "counter", "Bytes read from block files into the CPU tier."),
        _m("stored_blocks", "counter",
           "Blocks stored, by outcome: written (a new file) or present (a valid "
           "file was already there).", "outcome"),
        _m("loaded_blocks", "counter",
           "Blocks loaded into the CPU tier, by verification: verified (trailer and "
           "checksum) or unverified (trailer-less file of vLLM's built-in tier).",
           "verification"),
        _m("store_failures", "counter",
           "Store blocks not published, by reason: queue_full, space (space guard or "
           "ENOSPC), stalled, deadline, error, cancelled.", "reason"),
        _m("load_failures", "counter",
           "Load blocks not delivered, by reason: missing, corrupt, deadline, "
           "stalled, error, cancelled.", "reason"),
        _m("corrupt_blocks", "counter",
           "Block files refused on load, by what was wrong (the quarantine file "
           "names and llmkv-fs verify use the same words): bad-checksum, truncated, "
           "bad-length, wrong-key, bad-magic, bad-version, bad-trailer, symlink.", "reason"),
        _m("quarantined_files", "counter", "Bad block files moved to .quarantine/."),
        _m("deadline_expiries", "counter",
           "Blocks failed because their job passed job_timeout_s."),
        _m("lookups", "counter",
           "Per-chunk lookups answered, by result: hit, miss, retry (check pending), "
           "deadline_miss (a pending check answered miss after the deadline).", "result"),
        _m("store_job_seconds", "histogram", "Store job latency, submit to result, seconds."),
        _m("load_job_seconds", "histogram", "Load job latency, submit to result, seconds."),
        _m("queued_blocks", "gauge", "Blocks waiting for an I/O thread, by direction.",
           "direction"),
        _m("busy_threads", "gauge", "I/O threads inside a block transfer."),
        _m("stuck_blocks", "gauge",
           "Blocks still inside a syscall after their job's deadline (volume stalled)."),
        _m("space_guard_tripped", "gauge", "1 while the space guard refuses stores."),
        _m("volume_used_bytes", "gauge", "Used bytes of the volume (statvfs, sampled)."),
        _m("volume_free_bytes", "gauge", "Bytes available on the volume (statvfs, sampled)."),
    )
}

_DIRECT = {
    "bytes_written": ("written_bytes", ()),
    "bytes_read": ("read_bytes", ()),
    "blocks_written": ("stored_blocks", ("written",)),
    "blocks_present": ("stored_blocks", ("present",)),
    "blocks_verified": ("loaded_blocks", ("verified",)),
    "blocks_unverified": ("loaded_blocks", ("unverified",)),
    "store_blocks_dropped_queue_full": ("store_failures", ("queue_full",)),
    "store_blocks_dropped_space": ("store_failures", ("space",)),
    "store_blocks_dropped_stalled": ("store_failures", ("stalled",)),
    "store_deadline_failed": ("store_failures", ("deadline",)),
    "store_errors": ("store_failures", ("error",)),
    "store_cancelled": ("store_failures", ("cancelled",)),
    "load_missing": ("load_failures", ("missing",)),
    "load_blocks_failed_stalled": ("load_failures", ("stalled",)),
    "load_deadline_failed": ("load_failures", ("deadline",)),
    "load_errors": ("load_failures", ("error",)),
    "load_cancelled": ("load_failures", ("cancelled",)),
    "quarantined": ("quarantined_files", ()),
    "blocks_deadline_expired": ("deadline_expiries", ()),
    "lookup_hits": ("lookups", ("hit",)),
    "lookup_misses": ("lookups", ("miss",)),
    "lookup_retries": ("lookups", ("retry",)),
    "lookups_deadline_missed": ("lookups", ("deadline_miss",)),
}

_GAUGES = {
    "busy_threads": ("busy_threads", ()),
    "stuck_blocks": ("stuck_blocks", ()),
    "space_guard_tripped": ("space_guard_tripped", ()),
    "volume_used_bytes": ("volume_used_bytes", ()),
    "volume_free_bytes": ("volume_free_bytes", ()),
    "queued_store_blocks": ("queued_blocks", ("store",)),
    "queued_load_blocks": ("queued_blocks", ("load",)),
}


def _counter_target(key: str) -> list[tuple[str, tuple[str, ...]]]:
    """Engine counter name -> the metric series it feeds (a corrupt load
    feeds two: the failure and what was corrupt)."""
    if key in _DIRECT:
        suffix, labels = _DIRECT[key]
        return [(suffix, labels)]
    if key.startswith("load_corrupt_"):
        reason = key[len("load_corrupt_"):]
        return [("load_failures", ("corrupt",)), ("corrupt_blocks", (reason,))]
    return []


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {name: metric.metadata() for name, metric in METRICS.items()}


class TierMetrics:
    """Turns an engine's cumulative counters, latency lists and gauges into
    one OffloadingConnectorStats per ``take_stats`` call (deltas since the
    previous call), labelled with this tier's label."""

    def __init__(self, engine, tier_label: str):
        self._engine = engine
        self._label = tier_label
        self._reported: collections.Counter[str] = collections.Counter()

    def take_stats(self) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        engine = self._engine
        for key, total in list(engine.counters.items()):
            delta = total - self._reported[key]
            if not delta:
                continue
            self._reported[key] = total
            for suffix, labels in _counter_target(key):
                stats.increase_counter(PREFIX + suffix, delta, (self._label, *labels))
        for direction in list(engine.job_latencies):
            taken, engine.job_latencies[direction] = engine.job_latencies[direction], []
            for seconds in taken:
                stats.observe_histogram(PREFIX + f"{direction}_job_seconds", seconds, (self._label,))
        for key, value in engine.gauges().items():
            suffix, labels = _GAUGES[key]
            stats.set_gauge(PREFIX + suffix, value, (self._label, *labels))
        return stats
