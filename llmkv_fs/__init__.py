"""llmkv_fs: a shared-filesystem KV-cache tier for vLLM's TieringOffloadingSpec.

The package is split into four rooms:

* ``llmkv_fs.layout`` -- paths, run-config digest, ``config.json`` and the block
  file format (no vLLM, no threads);
* ``llmkv_fs.engine`` -- thread pools, block I/O, lookups, NUMA (no vLLM);
* ``llmkv_fs.tier``   -- the thin vLLM adapter (``FsTier``) and plugin;
* ``llmkv_fs.ops``    -- command-line tools that read the layout.

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
