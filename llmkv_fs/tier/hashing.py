"""How this vLLM process hashes blocks, as a fingerprint that can be
published in a lease without revealing the seed.

Block hashes chain from ``NONE_HASH``, which vLLM derives from the
prefix-caching hash algorithm and ``PYTHONHASHSEED`` (a random seed when
the algorithm is not cryptographic and the variable is unset). Two replicas
share blocks only when their ``NONE_HASH`` agree, so the fingerprint is a
hash of ``NONE_HASH`` itself once vLLM has set it, and otherwise of the seed
vLLM would use.
"""

from __future__ import annotations

import os

from llmkv_fs.volume.leases import seed_fingerprint

_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _hash_algo(none_hash: bytes | None) -> str:
    """The prefix-caching hash algorithm in use. The tier is not handed the
    vLLM config, so it is recognised by recomputing NONE_HASH from vLLM's
    resolved seed with each algorithm; before NONE_HASH exists, the current
    vLLM config (if any) or LLMKV_FS_HASH_ALGO tells."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    if none_hash is not None:
        seed = get_none_hash_seed()
        for name in _ALGOS:
            try:
                if bytes(get_hash_fn_by_name(name)(seed)) == none_hash:
                    return name
            except Exception:  # an algorithm missing its optional dependency
                continue
    from vllm.config.vllm import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    algo = getattr(getattr(config, "cache_config", None), "prefix_caching_hash_algo", None)
    return str(algo) if algo else os.environ.get("LLMKV_FS_HASH_ALGO", "sha256")


def hashing_identity() -> tuple[str, str]:
    """(hash algorithm, fingerprint). Call after vLLM's init_none_hash (the
    tier does, at its first scheduling step)."""
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    none_hash = None if none_hash is None else bytes(none_hash)
    algo = _hash_algo(none_hash)
    if none_hash is not None:
        return algo, seed_fingerprint(algo, none_hash.hex())
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        seed = None if algo.startswith("xxhash") else kv_cache_utils.DEFAULT_NONE_HASH_SEED
    return algo, seed_fingerprint(algo, seed)
