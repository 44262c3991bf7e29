"""vLLM general plugin: make ``type: fs`` (and ``type: llmkv_fs``) resolve to
``llmkv_fs.FsTier``.

vLLM calls ``register()`` in every process that loads plugins (API server,
engine core, workers), possibly more than once. It must therefore be
idempotent and cheap: this module imports nothing at import time, and
``register`` only imports vLLM's tier factory (a module the engine core
loads anyway) -- never torch kernels, the tier itself or our engine.

Opt-out: ``LLMKV_FS_REPLACE_BUILTIN=0`` keeps vLLM's own ``fs`` tier and only
adds ``llmkv_fs``. vLLM's ``VLLM_PLUGINS`` filter skips this plugin entirely.
"""

from __future__ import annotations

import os

__all__ = ["REPLACE_ENV", "register"]

REPLACE_ENV = "LLMKV_FS_REPLACE_BUILTIN"
# The tier interface is experimental upstream; we test against these series
# (0.33 through the scheduler-side suite, 0.32 through a real server).
TESTED_VLLM_SERIES = ("0.32.", "0.33.")
_MODULE, _CLASS = "llmkv_fs.tier.fs_tier", "FsTier"


def _load_tier_class():
    import importlib

    return getattr(importlib.import_module(_MODULE), _CLASS)


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "unknown"


def register() -> None:
    import logging

    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from llmkv_fs import __version__

    registry = SecondaryTierFactory._registry
    replace = os.environ.get(REPLACE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    wanted = ["llmkv_fs", "fs"] if replace else ["llmkv_fs"]
    changed = [name for name in wanted if registry.get(name) is not _load_tier_class]
    for name in changed:
        # register_tier() refuses to replace an entry; taking over the
        # built-in "fs" is the point of this plugin, so set it directly.
        registry[name] = _load_tier_class
    if changed:
        logger = logging.getLogger("vllm.llmkv_fs")
        vllm_version = _vllm_version()
        if not vllm_version.startswith(TESTED_VLLM_SERIES):
            logger.warning(
                "llmkv_fs %s is tested with vLLM %s, this is vLLM %s: the secondary "
                "tier interface may have changed",
                __version__,
                " and ".join(f"{series}x" for series in TESTED_VLLM_SERIES),
                vllm_version,
            )
        logger.info(
            "llmkv_fs %s registered secondary tier type(s) %s%s",
            __version__,
            ", ".join(repr(n) for n in wanted),
            "" if replace else f" ({REPLACE_ENV}=0: vLLM's built-in 'fs' kept)",
        )
