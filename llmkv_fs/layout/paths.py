"""Where things live on the volume. Pure functions and immutable objects: no
vLLM, no I/O, so the engine, the tier and the ops tools share one answer.

The layout is vLLM 0.33's ``FileMapper`` layout, byte for byte::

    <root>/<model>_<digest>/config.json
    <root>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin

``digest`` is the first 12 hex digits of sha256 over the canonical JSON of
the run-config fields, so two replicas with the same model, dtype, block
size, parallelism (unless parallel-agnostic) and KV groups share a directory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from typing import Any

__all__ = [
    "BLOCK_SUFFIX",
    "CONFIG_FILENAME",
    "QUARANTINE_DIRNAME",
    "CacheLayout",
    "LayoutError",
    "RunIdentity",
    "TempName",
    "parse_temp_name",
    "split_key",
]

CONFIG_FILENAME = "config.json"
BLOCK_SUFFIX = ".bin"
QUARANTINE_DIRNAME = ".quarantine"
_DIGEST_LEN = 12
_NAME_MAX = 255  # bytes in one path component on every Linux filesystem we target
# An OffloadKey is <block hash><4-byte big-endian KV group index>.
_GROUP_BYTES = 4


class LayoutError(ValueError):
    """A name from the configuration cannot become a safe path component."""


def split_key(key: bytes) -> tuple[bytes, int]:
    """Split an OffloadKey into (block hash, KV group index)."""
    return key[:-_GROUP_BYTES], int.from_bytes(key[-_GROUP_BYTES:], "big")


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
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:_DIGEST_LEN]


def safe_model_component(model_name: str) -> str:
    """vLLM's escaping ('/' -> '_'), plus the checks it leaves out.

    With '/' gone and the digest appended, no model name can climb out of the
    root ("../x" becomes ".._x_<digest>"); NUL and over-long names would only
    fail later with an obscure OSError, so they are refused here.
    """
    if "\0" in model_name:
        raise LayoutError(f"model name {model_name!r} contains a NUL byte")
    safe = model_name.replace("/", "_")
    # Longest sibling we create: the rank directory, with room for 5-digit ranks.
    if len(f"{safe}_{'0' * _DIGEST_LEN}_r99999".encode()) > _NAME_MAX:
        raise LayoutError(
            f"model name {model_name!r} is too long for a path component "
            f"({_NAME_MAX} bytes including the digest suffix)"
        )
    return safe


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
        return f"{safe_model_component(self.run_config['model_name'])}_{self.digest}"

    @functools.cached_property
    def base_path(self) -> str:
        # String concatenation, not os.path.join, to match vLLM byte for byte.
        # digest_dir_name is one path component ending in "_<digest>", so
        # it can be neither "." nor ".." nor contain "/": it stays in root.
        return f"{self.root_dir}/{self.digest_dir_name}"

    @functools.cached_property
    def config_path(self) -> str:
        return f"{self.base_path}/{CONFIG_FILENAME}"

    @functools.cached_property
    def rank_dir(self) -> str:
        return f"{self.base_path}_r{self.rank}"

    @functools.cached_property
    def quarantine_dir(self) -> str:
        return f"{self.rank_dir}/{QUARANTINE_DIRNAME}"

    def block_path(self, key: bytes) -> str:
        block_hash, group = split_key(key)
        h = block_hash.hex()
        return f"{self.rank_dir}/{h[:3]}/{h[3:5]}_g{group}/{h}{BLOCK_SUFFIX}"


@dataclasses.dataclass(frozen=True)
class TempName:
    host: str
    pid: int
    nonce: str


# ".<final name>.<host>~<pid>~<nonce>.tmp": hidden (a leading dot keeps it out
# of globbing tools), and it names its writer so gc can prove a writer dead.
# Host names contain dots, so the final name is anchored on its suffix.
_TEMP_RE = re.compile(
    r"^\.(?P<final>.+?\.(?:bin|json))\.(?P<host>[^~/]+)~(?P<pid>\d+)~(?P<nonce>[0-9a-z]+)\.tmp$"
)


def temp_path(final_path: str, host: str, pid: int, nonce: str) -> str:
    directory, name = os.path.split(final_path)
    return f"{directory}/.{name}.{host}~{pid}~{nonce}.tmp"


def parse_temp_name(name: str) -> TempName | None:
    match = _TEMP_RE.match(name)
    if match is None:
        return None
    return TempName(match["host"], int(match["pid"]), match["nonce"])
