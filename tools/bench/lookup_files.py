"""The files tools/bench/lookup.py checks: where each tier keeps them (ours'
tree and the built-in's, through the writing client and the checking one),
the keys of the hits and the misses, our engine opened on them, and the
prepare phase that stores the hits through each tier's own store path --
recorded in ``PREPARED`` so the measure phase can tell they match its
options."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
from typing import Any

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.layout.paths import CacheLayout
from tools.bench.support import IDENTITY, Primary, drive, make_keys

SUBDIR = "llmkv-bench-lookup"
PREPARED = "prepared.json"


class Places:
    """Where the files are: ours' root and the built-in's, through the
    writing client (``dir``) and the checking one (``check_dir``)."""

    def __init__(self, directory: str, check_dir: str):
        self.top = os.path.join(directory, SUBDIR)
        self.check_top = os.path.join(check_dir, SUBDIR)

    def ours(self, checking: bool) -> str:
        return os.path.join(self.check_top if checking else self.top, "ours")

    def builtin(self, checking: bool) -> str:
        return os.path.join(self.check_top if checking else self.top, "builtin")

    def builtin_base(self, checking: bool) -> str:
        """Where the built-in's tier rooted at ``builtin`` puts its files
        (tools/bench/builtin.py's BuiltinTier)."""
        return os.path.join(self.builtin(checking), "vllm_builtin")


def hit_keys(n: int) -> list[bytes]:
    return make_keys(n, f"lookup-hit-{n}")


def miss_keys(n: int) -> list[bytes]:
    return make_keys(n, f"lookup-miss-{n}")


def ours_settings(root: str, lookup_threads: int) -> TierSettings:
    return TierSettings.from_mapping(
        {
            "root_dir": root,
            "lookup_threads": lookup_threads,
            "io_workers": 0,
            "n_read_threads": 4,
            "n_write_threads": 4,
            "numa_node": "off",
        }
    )


def ours_engine(root: str, lookup_threads: int, buffer: mmap.mmap, block: int) -> FsEngine:
    """Our engine on the tree at ``root``, copying through ``buffer``."""
    layout = CacheLayout.for_identity(root, IDENTITY)
    return FsEngine(ours_settings(root, lookup_threads), [layout], buffer, block)


def open_ours(root: str, lookup_threads: int, block: int) -> tuple[FsEngine, mmap.mmap]:
    """Our engine for checks only: a buffer of its own, a few blocks big."""
    buffer = mmap.mmap(-1, 4 * block)
    return ours_engine(root, lookup_threads, buffer, block), buffer


FANOUT = 16**3  # <hhh>: the first three hex digits of the block hash


def fanout_dirs(block_path: str) -> list[str]:
    """Every ``<hhh>`` directory beside the one ``block_path`` (a block's
    file, ``.../<hhh>/<hh>_g<g>/<name>``) lies in."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(block_path)))
    return [os.path.join(top, f"{i:03x}") for i in range(FANOUT)]


def make_fanout(places: Places, builtin: bool) -> None:
    """Make every ``<hhh>`` directory of ours' tree (and the built-in's), as
    on a volume holding many blocks: a miss is then decided one level
    below, in a directory of its own."""
    probe = make_keys(1, "fanout")[0]
    trees = [CacheLayout.for_identity(places.ours(False), IDENTITY).block_path(probe)]
    if builtin:
        from tools.bench.builtin import builtin_path

        trees.append(builtin_path(places.builtin_base(False), probe))

    def make(path: str) -> None:
        os.makedirs(path, exist_ok=True)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for tree in trees:
            list(pool.map(make, fanout_dirs(tree)))


def prepare(args: argparse.Namespace, places: Places, payload: Any) -> dict:
    """Store the hits through each tier's own store path (client A)."""
    block = args.block_kib * 1024
    keys = hit_keys(args.keys)
    os.makedirs(places.top, exist_ok=True)
    if args.fanout == "full":
        make_fanout(places, payload is not None)
    primary = Primary(args.keys, block, shm=False)
    took = {}
    try:
        root = places.ours(False)
        os.makedirs(root, exist_ok=True)
        engine = ours_engine(root, 4, primary.mm, block)
        try:
            took["ours"] = drive(engine, keys, 64, False, 0.001, 0)[0]
        finally:
            engine.shutdown()
        if payload is not None:
            from tools.bench.builtin import BuiltinTier

            root = places.builtin(False)
            os.makedirs(root, exist_ok=True)
            builtin = BuiltinTier(payload, root, primary.mm, block, 16)
            try:
                took["builtin"] = drive(builtin, keys, 64, False, 0.001, 0)[0]
            finally:
                builtin.shutdown()
    finally:
        primary.close()
    record = {
        "keys": args.keys,
        "block": block,
        "builtin": payload is not None,
        "fanout": args.fanout,
        "store_s": took,
    }
    with open(os.path.join(places.top, PREPARED), "w", encoding="utf-8") as f:
        json.dump(record, f)
    return record


def check_prepared(args: argparse.Namespace, places: Places, payload: Any) -> dict:
    """The record of the prepare phase, if it matches these options; else
    the run stops, naming the mismatch."""
    try:
        with open(os.path.join(places.top, PREPARED), encoding="utf-8") as f:
            record = json.load(f)
    except OSError:
        raise SystemExit(f"nothing prepared in {places.top}: run --phase prepare first") from None
    if record["keys"] != args.keys or record["block"] != args.block_kib * 1024:
        raise SystemExit(f"{places.top} was prepared with {record}, not these --keys/--block-kib")
    if payload is not None and not record["builtin"]:
        raise SystemExit(f"{places.top} was prepared without --builtin")
    if record.get("fanout") != args.fanout:
        raise SystemExit(f"{places.top} was prepared with --fanout {record.get('fanout')}")
    return record
