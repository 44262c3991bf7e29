"""Shared helpers for the layout tests: the same questions asked of vLLM's
FileMapper and of our CacheLayout."""

from __future__ import annotations

import hashlib

from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from llmkv_fs.layout.paths import (
    CacheLayout,
)
from llmkv_fs.tier.fs_tier import identity_from_spec
from llmkv_fs.volume.run_config import render_run_config
from tests.kits.tier_kit import offloading_config

ROOT = "/mnt/kvcache"
ONE_GROUP = ((16, ("model.layers.0.self_attn", "model.layers.1.self_attn")),)
TWO_GROUPS = (
    (16, ("model.layers.0.self_attn", "model.layers.2.self_attn")),
    (32, ("model.layers.1.self_attn.sliding", "model.layers.3.self_attn.sliding")),
)
KEYS = [
    make_offload_key(hashlib.sha256(b"first").digest(), 0),
    make_offload_key(hashlib.sha256(b"second").digest(), 0),
    make_offload_key(hashlib.sha256(b"first").digest(), 1),
    make_offload_key(hashlib.sha256(b"third").digest(), 1),
    make_offload_key(b"\x00\x00\x01" + bytes(29), 0),  # leading zero nibbles
    make_offload_key(bytes.fromhex("0123456789abcdef"), 1),  # a short (8-byte) hash
    make_offload_key(hashlib.sha256(b"big-group").digest(), 0x80000001),
]


def vllm_mapper(spec: TieringOffloadingSpec, root: str = ROOT) -> FileMapper:
    """Exactly how vLLM's FileSystemTierManager builds its mapper."""
    return FileMapper.from_offloading_spec(
        root_dir=root,
        offloading_spec=spec,
        blocks_per_file=spec.blocks_per_chunk,
        parallel_agnostic=True,
    )


def our_layout(spec: TieringOffloadingSpec, root: str = ROOT) -> CacheLayout:
    return CacheLayout.for_identity(root, identity_from_spec(spec))


def spec_for(**kw) -> TieringOffloadingSpec:
    kw.setdefault("tiers", [])
    return TieringOffloadingSpec(offloading_config(**kw))


def assert_same_layout(spec: TieringOffloadingSpec, root: str = ROOT) -> CacheLayout:
    theirs = vllm_mapper(spec, root)
    mine = our_layout(spec, root)
    assert mine.base_path == theirs.base_path
    assert mine.config_path == theirs.get_config_file_path()
    assert mine.run_config == theirs.get_run_config()
    assert render_run_config(mine.run_config) == render_run_config(theirs.get_run_config())
    for key in KEYS:
        assert mine.block_path(key) == theirs.get_file_name(key), key.hex()
    return mine
