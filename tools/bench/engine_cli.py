"""The command line of tools/bench/engine.py (its options and their parsing)."""

from __future__ import annotations

import argparse

from llmkv_fs.config import setting_option
from llmkv_fs.harness.bench_media import roots_of
from tools.bench.variants import parse_variant

__all__ = ["io_workers_setting", "media_of", "parse_args"]


# The tier settings these options set, checked by the settings' own checks.
io_workers_setting = setting_option("io_workers")
numa_setting = setting_option("numa_node")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def media_of(dirs: list[str], root_sets: list[int]) -> list[tuple[str, ...]]:
    """The media a run measures, each a tuple of roots: without root sets one
    per --dir (a comma list is one medium of several roots, our engine with
    path_sharding by_block_hash over them); with root sets one medium of every
    root given, whose first k roots each set k uses."""
    split = [tuple(roots_of(d)) for d in dirs]
    if not root_sets:
        return split
    flat = tuple(r for roots in split for r in roots)
    if min(root_sets) < 1 or max(root_sets) > len(flat):
        raise SystemExit(f"--root-sets: each count must be 1..{len(flat)} (the roots given)")
    return [flat]


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--dir",
        action="append",
        required=True,
        help="medium (repeat); a comma list is one medium of several roots (ours shards "
        "blocks over them; the built-in runs on the first)",
    )
    p.add_argument(
        "--root-sets",
        type=int_list,
        default=[],
        metavar="K,K,...",
        help="one medium of all --dir roots; ours runs on the first K of them for each K "
        "(e.g. 1,2,4), in the same rounds as the built-in (on the first root)",
    )
    p.add_argument(
        "--per-side",
        "--threads",
        dest="per_side",
        action="append",
        type=int,
        help="sweep: threads per side, or io_workers / 2 (default 1 2 4 8 16)",
    )
    p.add_argument(
        "--mode",
        action="append",
        choices=("threads", "workers"),
        help="threads (io_workers=0) and/or workers (repeat; default threads)",
    )
    p.add_argument(
        "--io-workers",
        type=io_workers_setting,
        help="workers mode: this io_workers setting (auto or N) instead of 2 x per side",
    )
    p.add_argument(
        "--ours",
        action="append",
        type=parse_variant,
        metavar="NAME:KEY=VALUE,...",
        help="our engine with a knob turned (repeat; tools/bench/variants.py)",
    )
    p.add_argument(
        "--standin",
        choices=("off", "on", "both"),
        default="off",
        help="run the scheduler stand-in thread during the runs",
    )
    p.add_argument(
        "--state",
        choices=("cold", "steady", "both"),
        default="cold",
        help="cold: measure the first pass of a fresh engine; steady: after a warm-up pass",
    )
    p.add_argument(
        "--numa",
        action="append",
        type=numa_setting,
        help='numa_node settings to compare (repeat; default "off" and "auto")',
    )
    p.add_argument("--reference", metavar="BINARY", help="compiled tools/bench/ref_blockio.c")
    p.add_argument(
        "--builtin",
        metavar="PAYLOAD_DIR",
        help="also run vLLM's built-in fs tier (payload of tools/bench/builtin_payload.py)",
    )
    p.add_argument(
        "--builtin-threads",
        type=int_list,
        default=[8],
        help="built-in read = write threads, comma separated (default 8)",
    )
    p.add_argument(
        "--case",
        action="append",
        choices=("many", "long"),
        help="many: --blocks in jobs of --blocks-per-job; long: one job of --long-blocks",
    )
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--blocks", type=int, default=256, help="blocks per direction per run")
    p.add_argument("--blocks-per-job", type=int, default=8)
    p.add_argument("--long-blocks", type=int, default=64, help="blocks of the long case's job")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--checksum", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--durability", default="none", choices=("none", "file", "full"))
    p.add_argument("--shm", action="store_true", help="primary buffer in /dev/shm (as vLLM's)")
    p.add_argument("--poll-ms", type=float, default=0.5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    args.per_side = args.per_side or [1, 2, 4, 8, 16]
    args.numa = args.numa or ["off", "auto"]
    args.mode = args.mode or ["threads"]
    args.case = args.case or ["many"]
    args.ours = args.ours or [parse_variant("shipped:")]
    if not args.builtin:
        args.builtin_threads = []
    args.media = media_of(args.dir, args.root_sets)
    return args
