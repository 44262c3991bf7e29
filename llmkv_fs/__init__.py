"""llmkv_fs: a shared-filesystem KV-cache tier for vLLM's TieringOffloadingSpec.

The package is split into rooms (docs/architecture.md has the import rule):

* ``llmkv_fs.layout``  -- every name on the volume, the run-config digest,
  ``config.json`` and the block file format (no vLLM, no threads);
* ``llmkv_fs.engine``  -- thread pools, block I/O, lookups, NUMA (no vLLM);
* ``llmkv_fs.tier``    -- the thin vLLM adapter (``FsTier``), plugin, metrics;
* ``llmkv_fs.ops``     -- the volume tools gc, stats, verify (layout only);
* ``llmkv_fs.harness`` -- the CPU-only vLLM driver, demo, bench, plots;
* ``llmkv_fs.cli``     -- the ``llmkv-fs`` command line on top of them all
  (also ``python -m llmkv_fs``).

Importing the package is cheap: ``FsTier`` (which imports vLLM) is resolved
lazily, so ``{"type": "FsTier", "module_path": "llmkv_fs"}`` works without
anything heavy happening at plugin-load time.
"""

__version__ = "0.1.0"

__all__ = ["FsTier", "__version__"]


def __getattr__(name: str):
    if name == "FsTier":
        from llmkv_fs.tier.fs_tier import FsTier

        return FsTier
    raise AttributeError(f"module 'llmkv_fs' has no attribute {name!r}")
