"""A snapshot announces only what a replica would serve: a 0-byte or
wrong-size file at a block path, something that is not a regular file, a
file behind a mount inside the tree are skipped (counted by why), and a
real router's index ends up holding exactly the servable blocks."""

from __future__ import annotations

import json
import os
import subprocess

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from llmkv_fs.layout.blockfile import TRAILER_SIZE
from llmkv_fs.ops.events.announcer import Announcer
from llmkv_fs.ops.events.config import parse_events_config
from llmkv_fs.ops.events.snapshot import snapshot
from tests.kits import gc_kit
from tests.kits.events_kit import Router, connect_announcer, read_announcer

DAY = 86400.0


def test_a_snapshot_skips_what_no_replica_would_serve(disk_root, mount_tmpfs):
    layout = gc_kit.make_digest(disk_root)[0]
    good = [gc_kit.key(i, "good") for i in range(5)]
    for k in good:
        gc_kit.put_block(layout, k, payload=64)
    # A trailer-less file of the block size: vLLM's built-in tier's, served.
    builtin = gc_kit.key(0, "builtin")
    gc_kit.put_block(layout, builtin, payload=64)
    with open(layout.block_path(builtin), "r+b") as f:
        f.truncate(64)
    bad = {
        "empty": b"",
        "short": b"x" * 10,
        "long": gc_kit.block_bytes(gc_kit.key(0, "long"), payload=80),
    }
    for name, data in bad.items():
        path = layout.block_path(gc_kit.key(0, name))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    fifo = layout.block_path(gc_kit.key(0, "fifo"))
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.mkfifo(fifo)
    # A block behind a tmpfs mounted inside the rank directory.
    hidden = next(
        k
        for k in (gc_kit.key(i, "hidden") for i in range(1000))
        if not os.path.exists(os.path.dirname(os.path.dirname(layout.block_path(k))))
    )
    mountpoint = os.path.dirname(os.path.dirname(layout.block_path(hidden)))
    os.makedirs(mountpoint)
    subprocess.run(["mount", "--bind", mount_tmpfs("1m"), mountpoint], check=True)
    try:
        gc_kit.put_block(layout, hidden, payload=64)
        assert os.stat(layout.block_path(hidden)).st_size == 64 + TRAILER_SIZE

        router = Router()
        announce = Announcer([parse_events_config(json.dumps({"endpoint": router.endpoint}))])
        try:
            connect_announcer(router, announce)
            summary = snapshot([disk_root], announce, rate=1e6)
            read_announcer(router, announce)
        finally:
            announce.close()
            router.close()
    finally:
        subprocess.run(["umount", "-l", mountpoint], check=False)
    assert router.index == {maybe_convert_block_hash(k[:-4]) for k in [*good, builtin]}
    assert summary["blocks"] == 6
    (per_root,) = summary["roots"]
    assert per_root["skipped"] == {"wrong size": 3, "behind a mount": 1}
