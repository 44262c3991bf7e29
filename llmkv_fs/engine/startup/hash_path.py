"""Which xxh3 code the checksum runs on this machine, for the start-up log
and the ``llmkv_fs_checksum_xxh3`` label of vLLM's config-info gauge.

python-xxhash 4.1 links xxHash's x86 dispatcher, which picks the widest of
SSE2, AVX2 and AVX-512 that the CPU and the kernel support when the module
loads; 4.0 and older run SSE2 on x86-64 whatever the CPU (docs/benchmarks.md
has what that costs). The dispatcher does not report its choice, so it is inferred here
from the CPU flags the kernel publishes (which already leave out what the
kernel does not enable). Two blind spots, both outside what pip installs: a
python-xxhash built against a system libxxhash (``XXHASH_LINK_SO``) runs
whatever that library was built with; and the answer is the engine-core
process's, which worker processes share (same interpreter, same path) unless
a benchmark puts another xxhash on their PYTHONPATH (tools/bench/variants.py,
``site=``). Reads /proc/cpuinfo once; any thread may call it.
"""

from __future__ import annotations

import functools
import platform

import xxhash

__all__ = ["xxh3_path", "xxh3_path_for"]

_DISPATCH_SINCE = (4, 1)


def xxh3_path_for(machine: str, cpu_flags: frozenset[str], xxhash_version: str) -> str:
    """The vector path of xxh3 for a CPU architecture, its flags and an
    xxhash version: ``avx512``, ``avx2``, ``sse2``, ``sse2-only`` (an xxhash
    without dispatch) or ``<machine>-build`` (what the wheel was built for)."""
    if machine not in ("x86_64", "AMD64", "i686", "i386"):
        return f"{machine}-build"
    try:
        version = tuple(int(part) for part in xxhash_version.split(".")[:2])
    except ValueError:
        version = (0, 0)
    if version < _DISPATCH_SINCE:
        return "sse2-only"
    if "avx512f" in cpu_flags:
        return "avx512"
    if "avx2" in cpu_flags:
        return "avx2"
    return "sse2"


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def xxh3_path() -> str:
    """This process's xxh3 path, e.g. ``avx512``."""
    return xxh3_path_for(platform.machine(), _cpu_flags(), xxhash.VERSION)
