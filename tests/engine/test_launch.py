"""What the engine decides once at start-up from the block size
(engine/launch.py): how many blocks of a job an executor place takes."""

from __future__ import annotations

import pytest

from llmkv_fs.engine.launch import slice_blocks

KiB, MiB = 1024, 1024 * 1024


@pytest.mark.parametrize(
    ("block", "most", "least"),
    [
        (16 * KiB, 64, 16),  # vLLM's e2e test's blocks: a 32-block job is two slices
        (64 * KiB, 64, 4),
        (256 * KiB, 16, 1),  # from here a lone job spreads one block per place
        (512 * KiB, 8, 1),
        (2 * MiB, 2, 1),
        (8 * MiB, 1, 1),
    ],
)
def test_a_slice_holds_at_most_4_mib_and_spreads_in_at_least_256_kib(block, most, least):
    assert slice_blocks(block) == (most, least)
