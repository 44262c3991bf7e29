"""``llmkv-fs``: the operator's command line. Subcommands import what they
need lazily, so ``llmkv-fs --help`` and layout-only tools start without vLLM."""

from __future__ import annotations

import argparse
import os
import sys

from llmkv_fs import __version__


def _demo(args: argparse.Namespace) -> int:
    # vLLM logs every tier creation at INFO; the demo's own story is the point.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from llmkv_fs.tier.demo import run_demo

    return run_demo(args)


def _bench(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from llmkv_fs.tier.bench import run_bench

    return run_bench(args)


def _config_doc(args: argparse.Namespace) -> int:
    import json

    from llmkv_fs.config import SETTINGS

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
    print("| `backpressure` | (none) | yes | Consumed by vLLM's tier factory, which hands "
          "the tier a detector; same meaning as for the built-in. |")
    return 0


# Operator tools that read the volume only (layout room, no vLLM). Each module
# exposes ``add_arguments(parser)`` and ``run(args) -> int``.
_VOLUME_TOOLS = {
    "gc": ("llmkv_fs.ops.gc", "keep a cache volume healthy: orphaned digests, stale temp files, capacity"),
    "stats": ("llmkv_fs.ops.stats", "what is on a cache volume, per digest"),
    "verify": ("llmkv_fs.ops.verify", "check every block's trailer and checksum"),
}


def _add_volume_tools(sub: argparse._SubParsersAction) -> None:
    import importlib

    for name, (module_name, help_text) in _VOLUME_TOOLS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # not written yet
        parser = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmkv-fs", description=__doc__)
    parser.add_argument("--version", action="version", version=f"llmkv-fs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="vLLM replicas in separate processes share KV chunks through llmkv_fs",
        description="Two replicas (separate processes, vLLM's real scheduler-side offloading "
        "stack on CPU) serve requests with shared prefixes and find each other's chunks on the "
        "volume; then a restarted replica finds them too. Exit status 0 only if every loaded "
        "byte matched and the restarted replica hit.")
    demo.add_argument("--root", help="cache root, e.g. a PVC mount (default: a temporary "
                      "directory, removed afterwards)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary root")
    demo.add_argument("--docs", type=int, default=4,
                      help="documents (shared prefixes) requests are built on (default 4)")
    demo.add_argument("--doc-chunks", type=int, default=8,
                      help="chunks (16 tokens each) per document (default 8)")
    demo.add_argument("--suffix-chunks", type=int, default=2,
                      help="unique chunks after the document in each request (default 2)")
    demo.add_argument("--requests", type=int, default=8,
                      help="requests each of the two first replicas serves (default 8)")
    demo.add_argument("--block-mib", type=int, default=2, help="chunk size in MiB (default 2)")
    demo.add_argument("--threads", type=int, default=4, help="read and write threads each")
    demo.add_argument("--cpu-chunks", type=int, default=0,
                      help="CPU tier size in chunks per replica (default: two requests)")
    demo.add_argument("--hash-algo", default="sha256",
                      choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
                      help="vLLM prefix-caching hash algorithm (default sha256)")
    demo.add_argument("--damage", choices=["bitflip", "trailerless"], help=argparse.SUPPRESS)
    demo.add_argument("--accept-trailerless", action="store_true", help=argparse.SUPPRESS)
    demo.set_defaults(func=_demo)

    from llmkv_fs.tier.bench import add_arguments as bench_arguments  # stdlib-only at import

    bench = sub.add_parser(
        "bench", help="llmkv_fs vs vLLM's built-in fs tier vs fio: GB/s, latency, plots")
    bench_arguments(bench)
    bench.set_defaults(func=_bench)

    doc = sub.add_parser("config-doc", help="print the settings table (docs/configuration.md)")
    doc.set_defaults(func=_config_doc)
    _add_volume_tools(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
