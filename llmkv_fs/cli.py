"""``llmkv-fs``: the command line, on top of every room (also ``python -m
llmkv_fs``). Subcommand modules are imported plainly here, so a renamed one
fails at import; none of them imports vLLM or torch at import time (the
harness does when a demo or bench runs), so ``llmkv-fs --help`` and the
volume tools start without them."""

from __future__ import annotations

import argparse
import json
import os

from llmkv_fs import __version__
from llmkv_fs.config import SETTINGS
from llmkv_fs.harness import bench, demo
from llmkv_fs.ops import doctor, gc, stats, verify
from llmkv_fs.ops.events import snapshot as events


def _demo(args: argparse.Namespace) -> int:
    # vLLM logs every tier creation at INFO; the demo's own story is the point.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return demo.run_demo(args)


def _bench(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return bench.run_bench(args)


def _config_doc(args: argparse.Namespace) -> int:
    print("| key | default | vLLM built-in key | meaning |")
    print("|---|---|---|---|")
    for s in SETTINGS:
        if s.required:
            default = "(required)"
        elif s.key in ("file_mode", "dir_mode"):  # JSON has no octal: shown as the string to write
            default = f'`"{s.default:04o}"`'
        else:
            default = f"`{json.dumps(s.default)}`"
        print(f"| `{s.key}` | {default} | {'yes' if s.vllm_builtin else 'no'} | {s.doc} |")
    print(
        "| `backpressure` | (none) | yes | Consumed by vLLM's tier factory, which hands "
        "the tier a detector; same meaning as for the built-in. |"
    )
    return 0


# Operator tools that read the volume only (ops room, no vLLM). Each module
# exposes ``add_arguments(parser)`` and ``run(args) -> int``.
_VOLUME_TOOLS = (
    ("gc", gc, "keep a cache volume healthy: orphaned digests, stale temp files, capacity"),
    ("stats", stats, "what is on a cache volume, per digest"),
    ("verify", verify, "check every block's trailer and checksum"),
    ("doctor", doctor, "why replicas do not share: deployments compared, every cause named"),
    ("events", events, "KV events for a router: snapshot (a BlockStored for every block)"),
)


def _add_volume_tools(sub: argparse._SubParsersAction) -> None:
    for name, module, help_text in _VOLUME_TOOLS:
        parser = sub.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)


def build_parser(prog: str = "llmkv-fs") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="llmkv_fs, a shared-filesystem KV-cache tier for vLLM: look "
        "after a cache volume (gc, stats, verify, doctor), see the tier at work (demo, bench).",
    )
    parser.add_argument("--version", action="version", version=f"llmkv-fs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo_parser = sub.add_parser(
        "demo",
        help="vLLM replicas in separate processes share KV chunks through llmkv_fs",
        description="Two replicas (separate processes, vLLM's real scheduler-side offloading "
        "stack on CPU) serve requests with shared prefixes and find each other's chunks on the "
        "volume; then a restarted replica finds them too. Exit status 0 only if every loaded "
        "byte matched and the restarted replica hit.",
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=_demo)

    bench_parser = sub.add_parser(
        "bench", help="llmkv_fs vs vLLM's built-in fs tier vs fio: GB/s, latency, plots"
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=_bench)

    doc = sub.add_parser("config-doc", help="print the settings table (docs/configuration.md)")
    doc.set_defaults(func=_config_doc)
    _add_volume_tools(sub)
    return parser


def main(argv: list[str] | None = None, prog: str = "llmkv-fs") -> int:
    args = build_parser(prog).parse_args(argv)
    return args.func(args)
