"""llmkv_fs: a shared-filesystem KV-cache tier for vLLM's TieringOffloadingSpec.

The package is split into rooms (docs/architecture.md has the import rule;
tests/test_rooms.py checks that this list and that page match the tree):

* ``llmkv_fs.layout``  -- what is on the volume, as pure definitions: every
  name, the run-config digest, the block file format, which root holds a block;
* ``llmkv_fs.volume``  -- the syscalls beneath the untrusted root: names
  resolved without following a link, files created new, leases, quarantine,
  ``config.json``, what the filesystem is and how full;
* ``llmkv_fs.engine``  -- moving blocks and answering lookups: the scheduler,
  I/O threads or worker processes, the block step, each root's upkeep (no vLLM);
* ``llmkv_fs.tier``    -- the thin vLLM adapter (``FsTier``), plugin, metrics;
* ``llmkv_fs.ops``     -- the volume tools gc, stats, verify (through
  ``volume`` and ``layout`` only, no vLLM);
* ``llmkv_fs.harness`` -- the CPU-only vLLM driver, demo, bench, plots;
* ``llmkv_fs.cli``     -- the ``llmkv-fs`` command line on top of them all
  (also ``python -m llmkv_fs``);
* base modules (``config``, ``declared``, ``checks``, ``units``, ``rootlist``)
  -- every setting declared once and the checks of values, imported by any
  room, importing none.

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
