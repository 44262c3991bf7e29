"""FsTier: the thin vLLM adapter. Translates vLLM's SecondaryTierManager
calls into FsEngine calls; holds no I/O logic of its own.

Threading: vLLM calls every method under the TieringOffloadingManager lock,
from the scheduler thread or its tier-poll thread, never concurrently. Each
method only enqueues, polls or consults in-memory state; the filesystem is
touched by the engine's threads. ``drain_jobs`` and ``shutdown`` block by
contract (reset and exit).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from llmkv_fs import __version__
from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FinishedJob, FsEngine, xxh3_path
from llmkv_fs.layout.paths import CacheLayout, RunIdentity
from llmkv_fs.layout.sealed import Keyring
from llmkv_fs.tier.hashing import hashing_identity
from llmkv_fs.tier.metrics import TierMetrics, metric_definitions
from llmkv_fs.tier.removals import RemovalWatch
from llmkv_fs.volume.leases import lease_for

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import ConfigInfoMapping, OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["FsTier", "identity_from_spec"]

logger = logging.getLogger("vllm.llmkv_fs.tier")

_VERDICT = {None: LookupResult.RETRY, True: LookupResult.HIT, False: LookupResult.MISS}


def identity_from_spec(spec: OffloadingSpec) -> RunIdentity:
    """The run identity vLLM's FileMapper derives for its fs tier
    (``from_offloading_spec(..., parallel_agnostic=True)``)."""
    config = spec.config
    parallel = config.parallel
    canonical_format = None
    if config.canonical_layout:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )

        assert config.kv_cache_layout is not None
        canonical_format = canonical_format_id(config.kv_cache_layout)
    return RunIdentity(
        model_name=config.model.name,
        dtype=config.model.dtype,
        tokens_per_hash=config.cache.tokens_per_hash,
        blocks_per_file=spec.blocks_per_chunk,
        kv_cache_groups=tuple(
            (group.tokens_per_block, tuple(group.layer_names)) for group in config.groups
        ),
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        pcp_size=parallel.pcp_size,
        dcp_size=parallel.dcp_size,
        rank=parallel.rank,
        parallel_agnostic=parallel.is_parallelism_agnostic or config.replicated_layout,
        replicated_layout=config.replicated_layout,
        canonical_format=canonical_format,
    )


class FsTier(SecondaryTierManager):
    """Shared-filesystem KV tier, on-disk compatible with vLLM's ``fs`` tier."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **tier_config: Any,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = TierSettings.from_mapping(tier_config)
        self.locality = Locality(self.settings.locality) if self.settings.locality else None
        self._events: list[OffloadingEvent] | None = None
        # What the tier knows is on the volume, to announce what it finds gone.
        self._removals: RemovalWatch | None = None
        if self.settings.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                logger.warning(
                    "enable_kv_events is set on tier %r but KV cache events are "
                    "disabled globally; no events will be emitted.",
                    tier_type,
                )
        identity = identity_from_spec(offloading_spec)
        layouts = [CacheLayout.for_identity(root, identity) for root in self.settings.root_dirs]
        if "," in self.settings.root_dir and self.settings.path_sharding == "none":
            logger.warning(
                "llmkv_fs: root_dir %r contains a comma and is used as one directory; "
                'to shard over several roots set path_sharding: "by_block_hash"',
                self.settings.root_dir,
            )
        self.engine = self._start_engine(layouts, primary_kv_view)
        if self._events is not None:
            self._removals = RemovalWatch(miss_was_checked=self.engine.miss_was_checked)
        self._metrics = TierMetrics(
            self.engine, _tier_label(offloading_spec, tier_type, self.settings)
        )
        self._lease_pending = True
        for root in self.engine.roots:
            logger.info(
                "llmkv_fs %s tier %r ready at %s (config.json %s)",
                __version__,
                tier_type,
                root.layout.rank_dir,
                root.run_config_state,
            )

    def _start_engine(self, layouts: list[CacheLayout], primary_kv_view: memoryview) -> FsEngine:
        """The tier's engine on ``layouts``. A subclass may start it with
        more of FsEngine's arguments (tests/kits/paused_tier.py: pause
        points)."""
        return FsEngine(self.settings, layouts, primary_kv_view, self.block_size_bytes)

    # -- lookups -----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        verdict = self.engine.lookup(key, req_context.req_id)
        if self._removals is not None and verdict is not None:
            self._removals.looked_up(key, verdict)
        return _VERDICT[verdict]

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.engine.forget_request(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._lease_pending:
            # Not at construction: vLLM derives NONE_HASH (from PYTHONHASHSEED)
            # after building the scheduler, and the lease must carry it.
            self._lease_pending = False
            algo, fingerprint = hashing_identity()
            settings = self.settings
            self.engine.set_lease(
                lease_for(
                    algo,
                    fingerprint,
                    settings.lease_interval_s,
                    _vllm_version(),
                    __version__,
                    roots=tuple(settings.root_dirs),
                    seal_keys=_seal_keys(self.engine.keyring),
                    max_usage_percent=settings.max_usage_percent,
                    min_free_bytes=settings.min_free_bytes,
                )
            )
        self.engine.end_step()

    # -- transfers ---------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self.engine.submit_store(
            job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids.tolist()
        )

    def submit_load(self, job_metadata: TransferJob) -> None:
        self.engine.submit_load(
            job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids.tolist()
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job in self.engine.take_finished():
            partial = job.is_load and job.failed and job.succeeded
            results.append(
                JobResult(
                    job_id=job.job_id,
                    success=job.success,
                    successful_keys=tuple(job.succeeded) if partial else None,
                    transfer_time=job.io_seconds,
                    transfer_bytes=len(job.succeeded) * self.block_size_bytes,
                )
            )
            if self._events is not None:
                self._note_events(job)
        return results

    def _note_events(self, job: FinishedJob) -> None:
        """BlockStored for stores that landed, BlockRemoved for files the
        job quarantined; what it found present or gone, for RemovalWatch."""
        assert self._events is not None and self._removals is not None
        removals = self._removals
        removals.present(job.succeeded, stored=not job.is_load)
        if not job.is_load and job.succeeded:
            self._events.append(
                OffloadingEvent(
                    keys=job.succeeded, medium=self.medium, removed=False, locality=self.locality
                )
            )
        if job.quarantined:
            removals.announced(job.quarantined)
            self._events.append(
                OffloadingEvent(
                    keys=job.quarantined, medium=self.medium, removed=True, locality=self.locality
                )
            )
        if job.missing:
            removals.gone(job.missing)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._removals is not None:
            assert self._events is not None
            for keys, removed in (
                (self._removals.take(), True),
                (self._removals.take_back(), False),
            ):
                if keys:
                    self._events.append(
                        OffloadingEvent(
                            keys=keys, medium=self.medium, removed=removed, locality=self.locality
                        )
                    )
        if self._events:
            events, self._events = self._events, []
            yield from events

    def has_pending_work(self) -> bool:
        return self.engine.has_pending_work()

    def drain_jobs(self) -> None:
        self.engine.drain()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # -- metrics -----------------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self._metrics.take_stats()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _CONFIG_INFO_KEYS

    def config_info(self) -> ConfigInfoMapping:
        s, engine = self.settings, self.engine
        return {
            "llmkv_fs_version": __version__,
            "llmkv_fs_read_threads": s.n_read_threads,
            "llmkv_fs_write_threads": s.n_write_threads,
            "llmkv_fs_numa_node": "off" if engine.pinning.node is None else engine.pinning.node,
            "llmkv_fs_io_mode": ",".join(
                "direct" if root.use_o_direct else "buffered" for root in engine.roots
            ),
            "llmkv_fs_path_sharding": s.path_sharding,
            "llmkv_fs_roots": len(engine.roots),
            "llmkv_fs_durability": s.durability,
            "llmkv_fs_checksum": s.checksum,
            "llmkv_fs_checksum_xxh3": xxh3_path(),
            "llmkv_fs_job_timeout_s": s.job_timeout_s,
        }


_CONFIG_INFO_KEYS = (
    "llmkv_fs_version",
    "llmkv_fs_read_threads",
    "llmkv_fs_write_threads",
    "llmkv_fs_numa_node",
    "llmkv_fs_io_mode",
    "llmkv_fs_path_sharding",
    "llmkv_fs_roots",
    "llmkv_fs_durability",
    "llmkv_fs_checksum",
    "llmkv_fs_checksum_xxh3",
    "llmkv_fs_job_timeout_s",
)


def _tier_label(spec: OffloadingSpec, tier_type: str, settings: TierSettings) -> str:
    """The value vLLM's tiering metrics use for this tier ("<index>:<type>",
    index 1 = first secondary tier), so our series join theirs."""
    tiers = spec.extra_config.get("secondary_tiers") or []
    for index, config in enumerate(tiers):
        if config.get("type") == tier_type and config.get("root_dir") == settings.root_dir:
            return f"{index + 1}:{tier_type}"
    return f"?:{tier_type}"


def _seal_keys(keyring: Keyring | None) -> tuple[str, ...]:
    """The lease's ``seal_keys``: "<id>:<key check hex>", the write key
    first. The check identifies a key without revealing it."""
    if keyring is None:
        return ()
    keys = [keyring.write, *(k for k in keyring.by_id.values() if k is not keyring.write)]
    return tuple(f"{k.key_id}:{k.check.hex()}" for k in keys)


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")
