"""Layout room: what is on the volume, as pure definitions -- every name,
the run-config digest (vLLM's FileMapper), the block file format, which root
a block lives on. No I/O, no vLLM, no threads; the engine, the tier and the
ops tools all name and read the volume through these."""

from llmkv_fs.layout.blockfile import TRAILER_SIZE, BlockFileError, Corruption, Trailer
from llmkv_fs.layout.paths import CacheLayout, LayoutError, RunIdentity

__all__ = [
    "TRAILER_SIZE",
    "BlockFileError",
    "CacheLayout",
    "Corruption",
    "LayoutError",
    "RunIdentity",
    "Trailer",
]
