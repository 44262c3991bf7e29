"""Layout room: where blocks live and what a block file holds. No vLLM, no
threads; the engine, the tier and the ops tools all read the volume through
these definitions."""

from llmkv_fs.layout.blockfile import TRAILER_SIZE, BlockFileError, Corruption, Trailer
from llmkv_fs.layout.paths import CacheLayout, LayoutError, RunIdentity
from llmkv_fs.layout.run_config import RunConfigMismatch, ensure_run_config

__all__ = [
    "TRAILER_SIZE",
    "BlockFileError",
    "CacheLayout",
    "Corruption",
    "LayoutError",
    "RunConfigMismatch",
    "RunIdentity",
    "Trailer",
    "ensure_run_config",
]
