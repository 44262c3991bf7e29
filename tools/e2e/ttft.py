"""Time to first token of a real ``vllm serve`` (vLLM's CPU build) for the
same prompt cold and served from a secondary tier after a restart -- ours
against vLLM's built-in ``fs`` tier in the same run, with the block files'
page cache warm and dropped.

For each tier: server 1 (empty root) serves, per prompt length, two prompts
cold (W and D) and stores them; after the stores, server 2 starts with an
empty CPU tier; D's block files are dropped from the page cache
(``posix_fadvise(DONTNEED)``, this process's files only: the machine is
shared), then W and D are served again. Each answer is compared with the answer
of a hit in vLLM's own prefix cache on server 1 (vLLM's block = our chunk, so
both compute the same remaining tokens; a cold prefill computes them in
another order, which in bf16 may flip a greedy token of a random model).
``LLMKV_FS_REPLACE_BUILTIN=0`` keeps vLLM's own ``fs`` for the built-in runs,
and the server log proves which tier served.

Imports neither vLLM nor torch (the servers run in the e2e venv);
matplotlib (the [bench] extra) draws the plot when it is installed.
Process rule: one server at a time. From the repository's root::

    python -m tools.e2e.ttft --root /var/tmp/bench_e2e --out docs/bench/e2e_ttft.json \
        --plot docs/bench/e2e_ttft.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from llmkv_fs.harness.machine import machine_info
from tools.e2e import venv as e2e_venv
from tools.e2e.server import ServeConfig, Server, block_files, temp_files, wait_for

TIERS = {"llmkv_fs": True, "vllm": False}  # name -> LLMKV_FS_REPLACE_BUILTIN
OUR_READY_LINE = "tier 'fs' ready"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--root", default="/var/tmp/llmkv_fs_bench_e2e", help="cache root (a disk, for page cache)"
    )
    p.add_argument(
        "--lengths",
        default="1024,2048,4096,8192",
        help="prompt lengths in tokens, comma-separated (default 1024,2048,4096,8192)",
    )
    p.add_argument("--tiers", default="llmkv_fs,vllm", help="llmkv_fs, vllm or both")
    p.add_argument(
        "--shape", default="bench", help="model shape of tools/e2e/model.py (bench, test)"
    )
    p.add_argument("--chunk-tokens", type=int, default=128, help="tokens per block file")
    p.add_argument(
        "--repeat", type=int, default=3, help="prompts per length and case (median TTFT)"
    )
    p.add_argument("--out", default="bench_e2e.json", help="results as JSON")
    p.add_argument("--plot", default=None, help="PNG path for the TTFT plot (needs matplotlib)")
    p.add_argument("--log-dir", default="/tmp", help="server logs")
    return p


def drop_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(tokens)]


def _wait_stored(root: str, at_least: int) -> list[str]:
    return wait_for(
        lambda: len(files := block_files(root)) >= at_least and not temp_files(root) and files,
        300,
        f"{at_least} block files under {root}",
    )


def run_tier(tier: str, lengths: list[int], args, venv, model, site, spec_dir) -> list[dict]:
    root = os.path.join(args.root, tier)
    os.makedirs(root, exist_ok=True)
    assert not block_files(root), f"{root} is not empty"
    config = ServeConfig(
        venv=venv,
        model=model,
        root_dir=root,
        pythonpath=[str(site), str(spec_dir)],
        replace_builtin=TIERS[tier],
        chunk_tokens=args.chunk_tokens,
        cpu_bytes=1 << 30,
        kv_cache_gib=1,
        log_dir=args.log_dir,
    )
    prompts = {
        (n, kind, i): _prompt(n * 100 + (kind == "D") * 10 + i, n)
        for n in lengths
        for kind in "WD"
        for i in range(args.repeat)
    }
    cold, hit, files_of = _store_cold(tier, config, prompts, root, args.chunk_tokens)
    return _serve_restarted(tier, config, prompts, cold, hit, files_of)


def _store_cold(tier: str, config: ServeConfig, prompts: dict, root: str, chunk_tokens: int):
    """Each prompt once cold (its TTFT and the files it stored) and once as a
    prefix-cache hit (the reference answer)."""
    cold, hit, files_of = {}, {}, {}
    server = Server(config, f"bench-{tier}-cold").start(900)
    try:
        server.complete(_prompt(0, 64))  # first request pays one-time costs
        for key, tokens in prompts.items():
            before = set(block_files(root))
            cold[key] = server.complete(tokens)
            # The reference answer: a hit in vLLM's own prefix cache computes
            # the same tokens as a tier hit (block = chunk), so in bf16 it is
            # the one a right tier must reproduce exactly.
            hit[key], _ = server.complete(tokens)
            stored = _wait_stored(root, len(before) + len(tokens) // chunk_tokens)
            files_of[key] = sorted(set(stored) - before)
    finally:
        server.stop()
    return cold, hit, files_of


def _serve_restarted(
    tier: str, config: ServeConfig, prompts: dict, cold: dict, hit: dict, files_of: dict
) -> list[dict]:
    """A restarted server (empty CPU tier) serves every prompt again from the
    tier: TTFT, page cache warm or dropped, and whether the output matches."""
    server = Server(config, f"bench-{tier}-restart").launch()
    try:
        server.wait_ready(900)
        served_by_us = OUR_READY_LINE in server.log_text()
        assert served_by_us == TIERS[tier], f"{tier}: wrong tier serving ({server.log_path})"
        server.complete(_prompt(0, 64))
        rows = []
        for key, tokens in prompts.items():
            n, kind, i = key
            if kind == "D":
                drop_page_cache(files_of[key])
            text, ttft = server.complete(tokens)
            rows.append(
                {
                    "tier": tier,
                    "tokens": n,
                    "page_cache": "warm" if kind == "W" else "dropped",
                    "sample": i,
                    "cold_ttft_s": cold[key][1],
                    "tier_ttft_s": ttft,
                    "files": len(files_of[key]),
                    "bytes": sum(os.path.getsize(p) for p in files_of[key]),
                    "same_output": text == hit[key],
                    "same_as_cold": text == cold[key][0],
                }
            )
    finally:
        server.stop()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """One row per (tier, length, page cache): medians over the samples."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["tier"], r["tokens"], r["page_cache"]), []).append(r)
    return [
        {
            "tier": tier,
            "tokens": n,
            "page_cache": cache,
            "samples": len(rs),
            "files": rs[0]["files"],
            "bytes": rs[0]["bytes"],
            "cold_ttft_s": statistics.median(r["cold_ttft_s"] for r in rs),
            "tier_ttft_s": statistics.median(r["tier_ttft_s"] for r in rs),
            "same_output": sum(r["same_output"] for r in rs),
            "same_as_cold": sum(r["same_as_cold"] for r in rs),
        }
        for (tier, n, cache), rs in groups.items()
    ]


def table(rows: list[dict]) -> str:
    out = [
        "| tier | prompt tokens | page cache | files | MB | cold TTFT s | from tier TTFT s "
        "| speed-up | same output as a prefix-cache hit | same as cold |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary(rows):
        k = r["samples"]
        out.append(
            f"| {r['tier']} | {r['tokens']} | {r['page_cache']} | {r['files']} "
            f"| {r['bytes'] / 1e6:.1f} | {r['cold_ttft_s']:.3f} | {r['tier_ttft_s']:.3f} "
            f"| {r['cold_ttft_s'] / r['tier_ttft_s']:.1f}x | {r['same_output']}/{k} "
            f"| {r['same_as_cold']}/{k} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> bool:
    rows = summary(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    lengths = sorted({r["tokens"] for r in rows})
    cold = [
        min(r["cold_ttft_s"] for r in rows if r["tokens"] == n) for n in lengths
    ]  # the fastest cold sample per length: recompute does not depend on the tier
    ax.plot(lengths, cold, "k--o", label="cold (recompute)")
    for tier in sorted({r["tier"] for r in rows}):
        for cache, style in (("warm", "-o"), ("dropped", ":s")):
            ys = [
                next(r["tier_ttft_s"] for r in rows if (r["tier"], r["tokens"], r["page_cache"])
                     == (tier, n, cache))
                for n in lengths
            ]  # fmt: skip
            ax.plot(lengths, ys, style, label=f"{tier}, page cache {cache}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, s")
    ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    ax.set_title("vllm serve (CPU): TTFT after a restart, from the fs tier")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",")]
    tiers = [t.strip() for t in args.tiers.split(",")]
    unknown = set(tiers) - set(TIERS)
    if unknown:
        raise SystemExit(f"--tiers: unknown {sorted(unknown)}; valid: {', '.join(TIERS)}")
    spec_dir = e2e_venv.REPO / "tests" / "kits"
    if not (spec_dir / "e2e_cpu_spec.py").exists():
        raise SystemExit(f"{spec_dir}/e2e_cpu_spec.py not found: run from a checkout")
    started = time.time()
    load_before = os.getloadavg()
    venv = e2e_venv.ensure_venv()
    model = e2e_venv.ensure_model(venv, args.shape)
    site = e2e_venv.install_checkout(venv, Path(args.log_dir) / "llmkv_fs_bench_e2e_site")
    rows = []
    for tier in tiers:
        rows += run_tier(tier, lengths, args, venv, model, site, spec_dir)
        print(table([r for r in rows if r["tier"] == tier]), flush=True)
    result = {
        "machine": machine_info([args.log_dir]),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "model": json.loads((model / "llmkv_fs_shape.json").read_text()),
        "chunk_tokens": args.chunk_tokens,
        "seconds": time.time() - started,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(rows))
    if args.plot and plot(rows, args.plot):
        print(f"plot: {args.plot}")
    return 0 if all(r["same_output"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
