"""Engine room: the block scheduler and its executors (I/O threads, worker
processes), moving one block, lookups, each root's upkeep and what is decided
at start-up (docs/architecture.md, "The engine"). Imports without vLLM or
torch (the standard library, xxhash, cryptography for sealed blocks, psutil
for leases; no numpy), so it can be driven and benchmarked on its own.

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

# Each public name and the module that holds it: the one list (``__all__``
# is made from it; the imports below say the same to type checkers, and
# tests/engine/test_package.py holds the two together).
_WHERE: dict[str, tuple[str, ...]] = {
    "llmkv_fs.engine.engine": ("FinishedJob", "FsEngine"),
    "llmkv_fs.engine.outcomes": (
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
        "MissReason",
        "Outcome",
        "StoreRefused",
        "Tally",
        "BlockOnLostRoot",
        "all_counter_keys",
    ),
    "llmkv_fs.engine.startup.hash_path": ("xxh3_path",),
    "llmkv_fs.engine.upkeep.prepare": (
        "EngineError",
        "PreparedVolume",
        "VolumeError",
        "prepare_volume",
    ),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}
__all__ = list(_MODULE_OF)

if TYPE_CHECKING:
    from llmkv_fs.engine.engine import FinishedJob as FinishedJob
    from llmkv_fs.engine.engine import FsEngine as FsEngine
    from llmkv_fs.engine.outcomes import CANCELLED as CANCELLED
    from llmkv_fs.engine.outcomes import DEADLINE as DEADLINE
    from llmkv_fs.engine.outcomes import Abandoned as Abandoned
    from llmkv_fs.engine.outcomes import BlockMissing as BlockMissing
    from llmkv_fs.engine.outcomes import BlockNotMoved as BlockNotMoved
    from llmkv_fs.engine.outcomes import BlockOnLostRoot as BlockOnLostRoot
    from llmkv_fs.engine.outcomes import BlockResult as BlockResult
    from llmkv_fs.engine.outcomes import CounterKey as CounterKey
    from llmkv_fs.engine.outcomes import Direction as Direction
    from llmkv_fs.engine.outcomes import Failed as Failed
    from llmkv_fs.engine.outcomes import Failure as Failure
    from llmkv_fs.engine.outcomes import LookupAnswer as LookupAnswer
    from llmkv_fs.engine.outcomes import MissReason as MissReason
    from llmkv_fs.engine.outcomes import Outcome as Outcome
    from llmkv_fs.engine.outcomes import StoreRefused as StoreRefused
    from llmkv_fs.engine.outcomes import Tally as Tally
    from llmkv_fs.engine.outcomes import all_counter_keys as all_counter_keys
    from llmkv_fs.engine.startup.hash_path import xxh3_path as xxh3_path
    from llmkv_fs.engine.upkeep.prepare import EngineError as EngineError
    from llmkv_fs.engine.upkeep.prepare import PreparedVolume as PreparedVolume
    from llmkv_fs.engine.upkeep.prepare import VolumeError as VolumeError
    from llmkv_fs.engine.upkeep.prepare import prepare_volume as prepare_volume


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain
    return value
