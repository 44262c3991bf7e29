"""How fast does gc scan a big volume? Generates a tree of N block-like files
in the real layout (tiny files, random hashes, random ages) and times a
dry-run scan, with gc's thread pool or with aiofiles, at several thread
counts. No vLLM.

    # one-off: generate, time, remove
    python tools/gc_scale.py bench --dir /var/tmp/gcscale --files 100000,300000

    # or step by step
    python tools/gc_scale.py generate /var/tmp/gcscale/t1 --files 100000
    python tools/gc_scale.py scan /var/tmp/gcscale/t1 --impl gc --threads 1,4,16
    python tools/gc_scale.py scan /var/tmp/gcscale/t1 --impl aiofiles --threads 16

``--impl``: ``gc`` = a full ``llmkv-fs gc --dry-run`` pass (scan + every
decision, in this process); ``walk`` = just ``ops.scan.walk`` (list and
lstat every entry); ``aiofiles`` = the same listing written with asyncio and
aiofiles (``aiofiles.os.scandir`` / ``aiofiles.os.stat`` on an executor of
``threads`` threads, ``threads`` directories in flight). ``--drop-caches``
empties the page/dentry/inode caches before each run (root; affects the
whole machine) so every lstat goes to the disk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from llmkv_fs.layout.paths import CacheLayout, RunIdentity
from llmkv_fs.layout.run_config import ensure_run_config
from llmkv_fs.ops import scan


def _identity(model: str, rank: int, ranks: int) -> RunIdentity:
    return RunIdentity(
        model_name=model,
        dtype="bfloat16",
        tokens_per_hash=16,
        blocks_per_file=1,
        kv_cache_groups=((16, ("layer.0",)),),
        tp_size=ranks,
        rank=rank,
    )


def generate(
    root: str,
    files: int,
    digests: int = 1,
    ranks: int = 1,
    file_bytes: int = 64,
    max_age_days: float = 30.0,
    seed: str = "gc-scale",
) -> dict:
    """``files`` block files spread over ``digests`` x ``ranks`` rank
    directories, names from sha256 (uniform over the 4096 x 256 buckets, as
    real hashes are), mtimes spread over ``max_age_days``."""
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    layouts = []
    for d in range(digests):
        for r in range(ranks):
            layout = CacheLayout.for_identity(root, _identity(f"scale/model-{d}", r, ranks))
            if r == 0:
                ensure_run_config(layout)
            layouts.append(layout)
    payload = b"k" * file_bytes
    now = time.time()
    made_dirs: set[str] = set()
    started = time.monotonic()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for i in range(files):
        layout = layouts[i % len(layouts)]
        key = hashlib.sha256(f"{seed}-{i}".encode()).digest() + b"\0\0\0\0"
        path = layout.block_path(key)
        directory = path.rpartition("/")[0]
        if directory not in made_dirs:
            os.makedirs(directory, exist_ok=True)
            made_dirs.add(directory)
        fd = os.open(path, flags, 0o640)
        try:
            if payload:
                os.write(fd, payload)
        finally:
            os.close(fd)
        when = int((now - rng.random() * max_age_days * 86400) * 1e9)
        os.utime(path, ns=(when, when))
        if i and i % 100_000 == 0:
            rate = i / (time.monotonic() - started)
            print(f"  generated {i:,} files ({rate:,.0f}/s)", file=sys.stderr, flush=True)
    return {"files": files, "dirs": len(made_dirs), "seconds": time.monotonic() - started}


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _tops(root: str) -> list[tuple[str, str]]:
    tops = []
    for d in scan.list_digests(root):
        if d.has_config_dir:
            tops.append((d.config_dir, scan.CONFIG_AREA))
        tops.extend((p, scan.RANK_AREA) for p in d.rank_dirs.values())
    return tops


def scan_walk(root: str, threads: int) -> tuple[int, int]:
    files = dirs = 0
    for listing in scan.walk(_tops(root), threads):
        dirs += 1
        files += len(listing.files)
    return files, dirs


def scan_aiofiles(root: str, threads: int) -> tuple[int, int]:
    """The same walk with asyncio + aiofiles: one task per directory,
    ``threads`` directories in flight, every syscall on the executor."""
    import aiofiles.os

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=threads))
        gate = asyncio.Semaphore(threads)
        counts = [0, 0]

        async def visit(path: str) -> None:
            async with gate:
                try:
                    # scandir's iterator reads lazily; drain it on the executor too.
                    entries = await loop.run_in_executor(None, lambda: list(os.scandir(path)))
                except FileNotFoundError:
                    return
                subdirs = []
                stats = []
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.path)
                    else:
                        stats.append(aiofiles.os.stat(entry.path, follow_symlinks=False))
                await asyncio.gather(*stats)
                counts[0] += len(stats)
                counts[1] += 1
            await asyncio.gather(*(visit(p) for p in subdirs))

        await asyncio.gather(*(visit(p) for p, _ in _tops(root)))
        return counts[0], counts[1]

    return asyncio.run(main())


def scan_gc(root: str, threads: int) -> tuple[int, int]:
    from llmkv_fs.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(
            [
                "gc",
                root,
                "--dry-run",
                "--json",
                "--threads",
                str(threads),
                "--max-bytes",
                "0",
                "--protect",
                "10m",
            ]
        )
    assert status == 0, out.getvalue()
    report = json.loads(out.getvalue())
    return report["scan"]["files"], report["scan"]["dirs"]


IMPLS = {"gc": scan_gc, "walk": scan_walk, "aiofiles": scan_aiofiles}


def time_scan(root: str, impl: str, threads: int, repeat: int, cold: bool) -> dict:
    samples = []
    files = dirs = 0
    for _ in range(repeat):
        if cold:
            drop_caches()
        started = time.monotonic()
        cpu = time.process_time()
        files, dirs = IMPLS[impl](root, threads)
        samples.append((time.monotonic() - started, time.process_time() - cpu))
    best = min(samples)
    return {
        "impl": impl,
        "threads": threads,
        "cold": cold,
        "files": files,
        "dirs": dirs,
        "seconds": [round(s, 3) for s, _ in samples],
        "best_s": round(best[0], 3),
        "cpu_s": round(best[1], 3),
        "files_per_s": round(files / best[0]),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write a tree")
    g.add_argument("root")
    g.add_argument("--files", type=int, required=True)
    g.add_argument("--digests", type=int, default=1)
    g.add_argument("--ranks", type=int, default=1)
    g.add_argument("--file-bytes", type=int, default=64)
    s = sub.add_parser("scan", help="time scans of an existing tree")
    s.add_argument("root")
    b = sub.add_parser("bench", help="generate, time and remove trees of several sizes")
    b.add_argument("--dir", required=True, help="where to put the trees (e.g. /var/tmp/gcscale)")
    b.add_argument("--files", type=_ints, default=[100_000, 300_000])
    b.add_argument("--keep", action="store_true", help="keep the trees")
    for p in (s, b):
        p.add_argument("--impl", default="gc", help="comma list of gc, walk, aiofiles")
        p.add_argument("--threads", type=_ints, default=[16])
        p.add_argument("--repeat", type=int, default=3)
        p.add_argument("--drop-caches", action="store_true")
    args = parser.parse_args(argv)

    if args.cmd == "generate":
        print(
            json.dumps(generate(args.root, args.files, args.digests, args.ranks, args.file_bytes))
        )
        return 0
    impls = args.impl.split(",")
    if args.cmd == "scan":
        for impl in impls:
            for threads in args.threads:
                print(
                    json.dumps(time_scan(args.root, impl, threads, args.repeat, args.drop_caches)),
                    flush=True,
                )
        return 0
    for n in args.files:
        root = os.path.join(args.dir, f"tree-{n}")
        if not os.path.isdir(root):
            made = generate(root, n)
            print(json.dumps({"generated": n, **made}), flush=True)
        for impl in impls:
            for threads in args.threads:
                # A process per configuration, so max_rss_mib is its own.
                subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "scan",
                        root,
                        "--impl",
                        impl,
                        "--threads",
                        str(threads),
                        "--repeat",
                        str(args.repeat),
                    ]
                    + (["--drop-caches"] if args.drop_caches else []),
                    check=True,
                )
        if not args.keep:
            shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
