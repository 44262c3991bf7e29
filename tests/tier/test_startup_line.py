"""The tier says it at start-up: a replica starting on a volume that holds
its model under another run-config digest logs one line per such digest,
naming it, its live replicas and the fields that differ -- through vLLM's
real offloading stack, in both I/O modes."""

from __future__ import annotations

import logging
import os

import pytest

from tests.kits.tier_kit import make_keys, ours, start, wait_until

pytestmark = pytest.mark.usefixtures("io_mode")

LAYERS = ("layer.0", "layer.1")


def other_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "under another digest" in r.getMessage()]


def test_a_replica_starting_beside_another_block_size_says_so_once(tmp_path, replicas, caplog):
    root = str(tmp_path / "v")
    old = start(replicas, ours(root), groups=((16, LAYERS),))
    old.store(make_keys(2))
    base = old.tier.engine.roots[0].layout.base_path

    def leased() -> bool:
        old.step()
        leases = base + "/leases"
        return os.path.isdir(leases) and any(n.endswith(".json") for n in os.listdir(leases))

    wait_until(leased, "its lease")
    caplog.set_level(logging.INFO, logger="vllm.llmkv_fs")
    start(replicas, ours(root), groups=((32, LAYERS),))
    (line,) = other_lines(caplog)
    assert old.tier.engine.roots[0].layout.digest_dir_name in line
    assert "holds blocks, 1 live replica(s)" in line
    assert "block_size 32 vs 16" in line and "dtype" not in line
    caplog.clear()
    start(replicas, ours(root), groups=((16, LAYERS),))  # the first one's config: one other
    (line,) = other_lines(caplog)
    assert "block_size 16 vs 32" in line and "no blocks, 0 live replica(s)" in line
