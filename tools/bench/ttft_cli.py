"""The command line of tools/bench/ttft.py (its options and their parsing).

``--help`` lists the options in the order they are added here, one group
after another: what a run measures, the tiers, recompute, how the tiers are
driven and the run bounded, the output."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tools.bench.ttft_shapes import SHAPES


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None, description: str) -> argparse.Namespace:
    """The options of a run (``description``: what ``--help`` says it does),
    their defaults filled in: the shapes and directories when none is
    given, io_workers as a count unless "auto", the poll interval in
    seconds (``poll_s``)."""
    p = argparse.ArgumentParser(description=description)
    _add_case_options(p)
    _add_tier_options(p)
    _add_recompute_options(p)
    _add_driving_options(p)
    _add_output_options(p)
    args = p.parse_args(argv)
    args.shapes = args.shapes or ["llama-3.1-8b"]
    args.dirs = args.dirs or ["/dev/shm/llmkv-ttft"]
    args.io_workers = args.io_workers if args.io_workers == "auto" else int(args.io_workers)
    args.poll_s = args.poll_ms / 1000
    return args


def _add_case_options(p: argparse.ArgumentParser) -> None:
    """What a run measures: shapes, lengths, chunk sizes, media, rounds."""
    p.add_argument(
        "--shape",
        "--model",
        dest="shapes",
        action="append",
        metavar="NAME_OR_PATH",
        help=f"model shape: {', '.join(SHAPES)} or a Hugging Face config (repeatable; "
        "default llama-3.1-8b)",
    )
    p.add_argument(
        "--lengths",
        type=_ints,
        default=_ints("4096,16384,32768,65536,131072"),
        help="prompt lengths in tokens (default 4096,16384,32768,65536,131072)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=_ints,
        default=[16, 256],
        help="tokens per chunk (one file; default 16,256)",
    )
    p.add_argument(
        "--dir",
        dest="dirs",
        action="append",
        help="a directory on a medium to test (repeatable: tmpfs, the disk...)",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed samples per case (median)")


def _add_tier_options(p: argparse.ArgumentParser) -> None:
    """The tiers: vLLM's built-in from a payload, and ours' io_workers."""
    p.add_argument(
        "--builtin",
        metavar="PAYLOAD_DIR",
        help="vLLM's built-in fs tier payload (tools/bench/builtin_payload.py)",
    )
    p.add_argument(
        "--builtin-threads",
        type=int,
        default=16,
        help="its read and write threads each (vLLM's default 16)",
    )
    p.add_argument(
        "--io-workers",
        default="auto",
        help="ours: io_workers (default auto, what an operator gets)",
    )


def _add_recompute_options(p: argparse.ArgumentParser) -> None:
    """Recompute, and the device it (and the KV's copy) runs on."""
    p.add_argument(
        "--recompute",
        choices=("auto", "transformers", "torch", "off"),
        default="auto",
        help="the prefill: transformers' model, the plain-torch one, or none; auto: "
        "transformers where installed",
    )
    p.add_argument(
        "--recompute-from",
        metavar="JSON",
        help="take recompute from an earlier run's JSON on this machine where it has every "
        "length (e.g. a second call for the disk); measured otherwise",
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (tests)")


def _add_driving_options(p: argparse.ArgumentParser) -> None:
    """How the tiers are driven and the run bounded."""
    p.add_argument("--max-gib", type=float, default=24.0, help="skip cases with more KV")
    p.add_argument(
        "--read-threads",
        type=_ints,
        default=[16, 32],
        help="plain-read reference thread counts (best counts; default 16,32)",
    )
    p.add_argument(
        "--store-job-tokens",
        type=int,
        default=2048,
        help="tokens per store job (one prefill step's worth)",
    )
    p.add_argument("--poll-ms", type=float, default=1.0, help="scheduler step / poll interval")
    p.add_argument("--settle-s", type=float, default=2.0, help="idle time of a new tier instance")
    p.add_argument("--job-deadline-s", type=float, default=300.0)
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no case after this many seconds (the JSON keeps what ran)",
    )
    p.add_argument("--shm", action="store_true", help="CPU tier in a /dev/shm file, not a memfd")
    p.add_argument(
        "--seal-key-file",
        metavar="PATH",
        help="ours: seal blocks with the key in PATH (seal_key_files, key id 1)",
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Where the results go, and the tamper self-check."""
    p.add_argument("--json", default="ttft.json", help="every sample (default %(default)s)")
    p.add_argument("--plot", default=None, help="PNG of seconds against length (matplotlib)")
    p.add_argument(
        "--tamper",
        action="store_true",
        help="self-check: flip one byte of one stored file before loading; every "
        "case must then fail",
    )
