"""Engine room: the block scheduler and its executors (I/O threads, worker
processes), moving one block, lookups, each root's upkeep and what is decided
at start-up (docs/architecture.md, "The engine"). Imports without vLLM
(stdlib, numpy-free, xxhash), so it can be driven and benchmarked on its own.

Its public names are here: construct ``FsEngine`` (it prepares the volume
itself), read its ``counters`` (keyed by the types of ``outcomes``). They are
resolved on first use, so that a worker process, which imports
``engine.workers.child`` (and with it this package), loads only what a
worker runs -- not the owner's engine, lookups, NUMA planning or leases
(a third of a worker's start-up, measured with ``python -X importtime``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmkv_fs.engine.engine import FinishedJob, FsEngine
    from llmkv_fs.engine.outcomes import (
        CANCELLED,
        DEADLINE,
        Abandoned,
        BlockMissing,
        BlockNotMoved,
        BlockResult,
        CounterKey,
        Direction,
        Failed,
        Failure,
        LookupAnswer,
        Outcome,
        StoreRefused,
        Tally,
        VolumeFailed,
        all_counter_keys,
    )
    from llmkv_fs.engine.startup.hash_path import xxh3_path
    from llmkv_fs.engine.upkeep.prepare import (
        EngineError,
        PreparedVolume,
        VolumeError,
        prepare_volume,
    )

_WHERE = {
    **dict.fromkeys(("FinishedJob", "FsEngine"), "llmkv_fs.engine.engine"),
    **dict.fromkeys(
        (
            "CANCELLED",
            "DEADLINE",
            "Abandoned",
            "BlockMissing",
            "BlockNotMoved",
            "BlockResult",
            "CounterKey",
            "Direction",
            "Failed",
            "Failure",
            "LookupAnswer",
            "Outcome",
            "StoreRefused",
            "Tally",
            "VolumeFailed",
            "all_counter_keys",
        ),
        "llmkv_fs.engine.outcomes",
    ),
    "xxh3_path": "llmkv_fs.engine.startup.hash_path",
    **dict.fromkeys(
        ("EngineError", "PreparedVolume", "VolumeError", "prepare_volume"),
        "llmkv_fs.engine.upkeep.prepare",
    ),
}

__all__ = [
    "CANCELLED",
    "DEADLINE",
    "Abandoned",
    "BlockMissing",
    "BlockNotMoved",
    "BlockResult",
    "CounterKey",
    "Direction",
    "EngineError",
    "Failed",
    "Failure",
    "FinishedJob",
    "FsEngine",
    "LookupAnswer",
    "Outcome",
    "PreparedVolume",
    "StoreRefused",
    "Tally",
    "VolumeError",
    "VolumeFailed",
    "all_counter_keys",
    "prepare_volume",
    "xxh3_path",
]


assert set(__all__) == set(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain
    return value
