"""Engine room: the block scheduler and its executors (I/O threads, worker
processes), moving one block, lookups, the volume's environment and NUMA
placement (docs/architecture.md, "The engine").
Imports without vLLM (stdlib, numpy-free, xxhash), so it can be driven and
benchmarked on its own.

Its public names are here: construct ``FsEngine`` (it prepares the volume
itself), read its ``counters`` (keyed by the types of ``outcomes``)."""

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
from llmkv_fs.engine.upkeep.prepare import EngineError, PreparedVolume, VolumeError, prepare_volume

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
