"""The command line of tools/bench/lookup.py (its options and their parsing)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from llmkv_fs.checks import int_between, option

__all__ = ["int_list", "parse_args"]

_COUNT = option(int_between(1, 1 << 24))


def int_list(text: str) -> list[int]:
    """A comma list of counts, each at least 1."""
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma list of counts >= 1, not {text!r}")
    return values


def parse_args(
    argv: Sequence[str] | None = None, description: str | None = None
) -> argparse.Namespace:
    """The options of a run (``description``: what ``--help`` says it does),
    with ``--check-dir`` defaulted and ``--single-keys`` clamped."""
    p = argparse.ArgumentParser(prog="python -m tools.bench.lookup", description=description)
    p.add_argument("--dir", required=True, help="where the files are written (client A)")
    p.add_argument(
        "--check-dir", help="the same directory through the client that checks (default --dir)"
    )
    p.add_argument("--keys", type=_COUNT, default=2048, help="blocks of the prompt (default 2048)")
    p.add_argument(
        "--threads",
        type=int_list,
        default=[4, 8, 16, 32, 64],
        metavar="T,T,...",
        help="lookup_threads of ours, and plain stat's thread counts (default 4,8,16,32,64)",
    )
    p.add_argument("--builtin", metavar="PAYLOAD_DIR", help="also vLLM's built-in lookups")
    p.add_argument("--rounds", type=_COUNT, default=2)
    p.add_argument("--phase", choices=("prepare", "measure", "all"), default="all")
    p.add_argument(
        "--keep", action="store_true", help="keep the files after --phase all (default: removed)"
    )
    p.add_argument(
        "--single-keys", type=int, default=256, help="sequential single checks (0: none)"
    )
    p.add_argument("--delay-us", type=float, default=0.0, help="the volume's added delay per fop")
    p.add_argument("--base-json", help="this benchmark's JSON at delay 0 on the same volume")
    p.add_argument("--settle-s", type=float, default=1.5, help="wait before each timed pass")
    p.add_argument("--step-ms", type=float, default=1.0, help="scheduler step interval")
    p.add_argument("--block-kib", type=int, default=128, help="block size of the files")
    p.add_argument(
        "--fanout",
        choices=("full", "prompt"),
        default="full",
        help="full: every <hhh> directory of both trees made at prepare (a volume holding "
        "many blocks); prompt: only those of the stored prompt (a young volume)",
    )
    p.add_argument("--gluster-volume", help="count the brick's file operations per single check")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.check_dir = args.check_dir or args.dir
    args.single_keys = min(args.single_keys, args.keys)
    return args
