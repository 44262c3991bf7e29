"""Where things live on the volume. Pure functions and immutable objects: no
vLLM, no I/O, so the engine, the tier and the ops tools share one answer.

The layout is vLLM 0.33's ``FileMapper`` layout, byte for byte::

    <root>/<model>_<digest>/config.json
    <root>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin

``digest`` is the first 12 hex digits of sha256 over the canonical JSON of
the run-config fields, so two replicas with the same model, dtype, block
size, parallelism (unless parallel-agnostic) and KV groups share a directory.
Each name itself is built (and parsed) in ``names.py``; this module puts the
names of one run config together.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any

from llmkv_fs.layout import names
from llmkv_fs.layout.names import LayoutError

__all__ = ["CacheLayout", "LayoutError", "RunIdentity", "run_config_digest"]


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What makes two engines' blocks interchangeable: the inputs of vLLM's
    ``FileMapper`` before its ``parallel_agnostic`` collapse."""

    model_name: str
    dtype: str
    tokens_per_hash: int
    blocks_per_file: int
    kv_cache_groups: tuple[tuple[int, tuple[str, ...]], ...]  # (tokens_per_block, layer names)
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    rank: int = 0
    parallel_agnostic: bool = False
    replicated_layout: bool = False
    canonical_format: str | None = None
    inference_engine: str = "vllm"

    def run_config(self) -> dict[str, Any]:
        """The dict vLLM writes to ``config.json`` and hashes into the digest."""
        tp, pp, pcp, dcp = self.tp_size, self.pp_size, self.pcp_size, self.dcp_size
        if self.parallel_agnostic:
            tp = pp = pcp = dcp = 1
        fields: dict[str, Any] = {
            "model_name": self.model_name,
            "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_file": self.blocks_per_file,
            "tp_size": tp,
            "pp_size": pp,
            "pcp_size": pcp,
            "dcp_size": dcp,
            "dtype": str(self.dtype),
            "kv_cache_groups": [
                {"tokens_per_block": tokens, "layer_names": list(layers)}
                for tokens, layers in self.kv_cache_groups
            ],
            "inference_engine": self.inference_engine,
        }
        # vLLM writes the flag only when False and replicated_layout only when
        # True so that older deployments keep their digests; mirror exactly.
        if not self.parallel_agnostic:
            fields["parallel_agnostic"] = False
        if self.replicated_layout:
            fields["replicated_layout"] = True
        if self.canonical_format is not None:
            fields["canonical_format"] = self.canonical_format
        return fields

    @property
    def effective_rank(self) -> int:
        return 0 if self.parallel_agnostic else self.rank


def run_config_digest(run_config: dict[str, Any]) -> str:
    canonical = json.dumps(run_config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[: names.DIGEST_LEN]


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Paths of one run config under one root. Immutable: every thread may
    call its methods concurrently. Derived paths are computed once (the
    digest is a sha256 over JSON: far too slow to redo per block)."""

    root_dir: str
    run_config: dict[str, Any]
    rank: int

    @classmethod
    def for_identity(cls, root_dir: str, identity: RunIdentity) -> CacheLayout:
        return cls(root_dir, identity.run_config(), identity.effective_rank)

    @functools.cached_property
    def digest(self) -> str:
        return run_config_digest(self.run_config)

    @functools.cached_property
    def digest_dir_name(self) -> str:
        return names.digest_dir_name(self.run_config["model_name"], self.digest)

    @functools.cached_property
    def base_path(self) -> str:
        # String concatenation, not os.path.join, to match vLLM byte for byte.
        # digest_dir_name is one path component ending in "_<digest>", so
        # it can be neither "." nor ".." nor contain "/": it stays in root.
        return f"{self.root_dir}/{self.digest_dir_name}"

    @functools.cached_property
    def config_path(self) -> str:
        return names.config_path(self.base_path)

    @functools.cached_property
    def rank_dir(self) -> str:
        return names.rank_dir_name(self.base_path, self.rank)

    @functools.cached_property
    def rank_dir_rel(self) -> str:
        """The rank directory relative to the root: one component, a
        sibling of the digest directory (``volume.beneath`` resolves it)."""
        return names.rank_dir_name(self.digest_dir_name, self.rank)

    @functools.cached_property
    def quarantine_dir(self) -> str:
        return names.quarantine_dir(self.rank_dir)

    def block_path(self, key: bytes) -> str:
        return f"{self.rank_dir}/{names.block_rel_path(key)}"
