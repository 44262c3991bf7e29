"""Drive vLLM 0.33's real scheduler-side offloading stack on CPU.

Used by the demo, the benchmark and the tests. ``Replica`` builds a real
``TieringOffloadingSpec`` -> ``TieringOffloadingManager`` (with a real
``SharedOffloadRegion`` in /dev/shm) and plays the parts vLLM's
scheduler and GPU workers would: it writes bytes into primary rows where the
GPU->CPU copy would, calls ``complete_store``, steps ``on_schedule_end``, and
reads promoted rows back. Waiting is polling with a deadline, never a bare
sleep.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

MiB = 1 << 20
DEADLINE_S = 30.0
_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def offloading_config(
    *,
    tiers: list[dict[str, Any]],
    model: str = "acme/llama-test",
    dtype: str = "bfloat16",
    block_bytes: int = 2 * MiB,
    cpu_bytes: int = 64 * MiB,
    tp_size: int = 1,
    rank: int = 0,
    agnostic: bool = False,
    groups: Sequence[tuple[int, Sequence[str]]] = ((16, ("layer.0", "layer.1")),),
    replicated_layout: bool = False,
    engine_id: str | None = None,
    enable_kv_events: bool = False,
) -> OffloadingConfig:
    """An OffloadingConfig as vLLM would build it for one engine.
    ``block_bytes`` is the KV bytes of one chunk across all workers."""
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=t, layer_names=tuple(names), group_id=i)
            for i, (t, names) in enumerate(groups)
        ),
        worker_kv_bytes_per_block=block_bytes // tp_size,
        enable_kv_cache_events=enable_kv_events,
        extra_config={"cpu_bytes_to_use": cpu_bytes, "secondary_tiers": tiers},
        engine_id=engine_id or f"llmkvtest_{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
        replicated_layout=replicated_layout,
    )


def ours(root: str, **extra: Any) -> dict[str, Any]:
    """Tier config selecting llmkv_fs by module path (works without the plugin)."""
    return {"type": "FsTier", "module_path": "llmkv_fs", "root_dir": str(root), **extra}


def builtin(root: str, **extra: Any) -> dict[str, Any]:
    """Tier config selecting vLLM's built-in fs tier (when no plugin replaced it)."""
    return {"type": "fs", "root_dir": str(root), **extra}


def make_keys(n: int, seed: str = "k", group: int = 0) -> list[bytes]:
    return [
        make_offload_key(hashlib.sha256(f"{seed}-{i}".encode()).digest(), group) for i in range(n)
    ]


def payload_for(key: bytes, size: int) -> bytes:
    """Deterministic, key-specific bytes filling a whole row."""
    seed = hashlib.sha256(key).digest()
    return (seed * (size // len(seed) + 1))[:size]


def wait_until(predicate: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.002)


class Replica:
    """One engine's scheduler-side offloading stack."""

    def __init__(self, config: OffloadingConfig):
        self.spec = TieringOffloadingSpec(config)
        self.manager = self.spec.get_manager()
        # The first secondary tier (FsTier or vLLM's own), None without one.
        self.tier: Any = self.manager.secondary_tiers[0] if self.manager.secondary_tiers else None
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())
        self.row_bytes = self.rows.shape[1]
        self._requests = 0

    # -- helpers -------------------------------------------------------------------

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(_STEP)

    def new_request(self) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=f"req-{self._requests}")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish_request(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def settle(self) -> None:
        """Step until no transfer is in flight."""

        def idle() -> bool:
            self.step()
            with self.manager.lock:
                return not self.manager.has_pending_work()

        wait_until(idle, "transfers to finish")

    # -- the GPU->CPU->tier path ---------------------------------------------------

    def store(
        self,
        keys: Sequence[bytes],
        payload: Callable[[bytes, int], bytes] = payload_for,
        settle: bool = True,
    ) -> ReqContext:
        ctx = self.new_request()
        with self.manager.lock:
            out = self.manager.prepare_store(list(keys), ctx)
        assert out is not None, "primary tier refused the store"
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            # Stand-in for the GPU->CPU DMA the worker would do.
            self.rows[chunk, :] = np.frombuffer(payload(key, self.row_bytes), dtype=np.int8)
        with self.manager.lock:
            # As vLLM's connector does: only what prepare_store asked for.
            self.manager.complete_store(list(out.keys_to_store), ctx)
        self.finish_request(ctx)
        if settle:
            self.settle()
        return ctx

    # -- the tier->CPU path --------------------------------------------------------

    def find(
        self,
        keys: Sequence[bytes],
        ctx: ReqContext | None = None,
        on_hit_pending: Callable[[bytes], None] | None = None,
    ) -> tuple[dict[bytes, LookupResult], list[list[LookupResult]]]:
        """Look keys up step by step, as the scheduler does, until each is HIT
        or MISS. Returns the final verdicts and the per-step history.
        ``on_hit_pending(key)`` runs once per key when the tier first found it
        (its load is submitted at the next step end): the moment to inject a
        fault between lookup and load."""
        ctx = ctx or self.new_request()
        history: list[list[LookupResult]] = []
        final: dict[bytes, LookupResult] = {}
        pending: set[bytes] = set()

        def resolved() -> bool:
            with self.manager.lock:
                results = [self.manager.lookup(k, ctx) for k in keys]
            history.append(results)
            for key, result in zip(keys, results):
                if result is LookupResult.HIT_PENDING and key not in pending:
                    pending.add(key)
                    if on_hit_pending is not None:
                        on_hit_pending(key)
            final.update(zip(keys, results))
            done = all(r in (LookupResult.HIT, LookupResult.MISS) for r in results)
            if not done:
                self.step()
            return done

        wait_until(resolved, "lookups to resolve")
        return final, history

    def close(self) -> None:
        # The view must go before vLLM unmaps the region (closed: rows is gone).
        self.rows = None  # type: ignore[assignment]
        self.manager.shutdown()
