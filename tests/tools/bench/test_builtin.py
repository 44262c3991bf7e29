"""tools/bench/builtin.py's path of a key is vLLM's FileMapper's, rank 0:
the fan-out is ours (layout/names.py's ``block_rel_path``), byte for byte."""

from __future__ import annotations

import hashlib

import pytest

from llmkv_fs.layout.names import offload_key
from tools.bench.builtin import builtin_path


@pytest.mark.parametrize("group", [0, 3, (1 << 32) - 1])
def test_builtin_path_is_the_file_mappers(group):
    key = offload_key(hashlib.sha256(f"k{group}".encode()).digest(), group)
    h = key[:-4].hex()  # vLLM's FileMapper.get_file_name, spelled out
    assert builtin_path("/r/vllm_builtin", key) == (
        f"/r/vllm_builtin_r0/{h[:3]}/{h[3:5]}_g{group}/{h}.bin"
    )
