"""Prefill recompute against a KV hit from a filesystem tier, on one GPU
server (issue 26): for each prompt length, model shape, chunk size and medium,
in the same run,

* recompute: the GPU prefill of the prompt, measured (random weights of the
  shape; transformers' model with SDPA when transformers is there, else a
  Llama-like prefill in plain torch), one request, median of ``--rounds``;
* ours: the prompt's KV made on the GPU, copied into a pinned CPU buffer of
  one chunk per row (vLLM's CPU primary tier), stored through our FsEngine
  with the settings an operator gets (io_workers auto, checksum on), the
  page cache of its files dropped (where the medium has one), the buffer
  zeroed; then timed: lookups of every chunk until all answer (lookup +
  end_step per step, as vLLM's scheduler polls), one promotion job of all
  chunks (as vLLM's tiering manager submits it), the rows copied to the GPU;
  every byte compared there;
* the built-in: the same through vLLM 0.33's own fs tier byte path
  (``--builtin PAYLOAD_DIR``, tools/bench/builtin.py), its lookups as its
  manager makes them (``BuiltinLookups``);
* on media with a page cache: a plain parallel read of our files into the
  same rows (threads, ``preadv``), the reference for our load's GB/s.

Run from the repository root on the GPU server (torch needed; transformers
and matplotlib optional; vLLM not needed)::

    python -m tools.bench.builtin_payload --out .bench_payload   # where vLLM 0.33 is
    python -m tools.bench.ttft --dir /dev/shm/ttft --dir /var/tmp/ttft \\
        --shape llama-3.1-8b --shape llama-3.2-1b --builtin .bench_payload \\
        --json ttft.json --plot ttft.png

``--shape`` takes a name of ``SHAPES`` (ttft_shapes.py) or a Hugging Face
config (a local path, or a hub name where the machine may fetch it).
``--device cpu --shape tiny`` runs everything on the CPU (tests). The exit
status is 1 when any case failed (bytes differ, a load or lookup failed).

This module is the run: the cases planned (skipped ones named), shape by
shape, one tier instance per medium and chunk size, the JSON saved after
every case. Its parts: ttft_shapes.py (model shapes), ttft_recompute.py
(the prefill timed), ttft_sides.py (the CPU tier stand-in and both tiers
driven as vLLM drives them), ttft_cases.py (one case measured), ttft_cli.py
(the options), ttft_plot.py (tables and plot).
"""

from __future__ import annotations

import importlib.metadata
import json
import mmap
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

from llmkv_fs.harness.machine import machine_info
from llmkv_fs.layout.paths import RunIdentity
from llmkv_fs.volume.fsinfo import filesystem_type
from tools.bench.ttft_cases import run_case
from tools.bench.ttft_cli import parse_args
from tools.bench.ttft_plot import plot, render_tables
from tools.bench.ttft_recompute import import_torch, measure_recompute, synchronizer
from tools.bench.ttft_shapes import Shape, resolve_shape
from tools.bench.ttft_sides import BuiltinSide, OursSide, PinnedRegion, Side

NOT_IN_FIGURES = (
    "Not in these figures: vLLM's scheduler and its own GPU copy. Here a bare loop polls "
    "every 1 ms; in vLLM each poll is an engine step (two at least before the promotion "
    "job is submitted, one after it finishes), so a busy engine adds up to three of its "
    "step times. The CPU->GPU copy here is one torch copy_ of the pinned rows, not vLLM's "
    "per-block copy kernels into its paged KV cache. Also left out: the prefill of the "
    "prompt's last partial chunk (up to one chunk less one token) and the first decode "
    "step, which a hit still computes (the same time added to every tier), and the "
    "stores, made while the first request is served. Recompute is one unchunked forward "
    "pass of random weights (transformers or plain torch, not vLLM's kernels); vLLM's "
    "chunked prefill of a long prompt takes longer."
)
GiB = 1 << 30
PAGE = mmap.PAGESIZE


# -- the run ------------------------------------------------------------------------------


def plan_cases(shape: Shape, args, recompute: dict) -> list[dict]:
    """Every (medium, chunk size, length) of a shape, skipped ones with why."""
    cases = []
    for medium in args.dirs:
        fs = filesystem_type(medium) or "?"
        for tokens_per_chunk in args.chunk_tokens:
            chunk = shape.chunk_bytes(tokens_per_chunk)
            for length in args.lengths:
                n = length // tokens_per_chunk
                case = {
                    "shape": shape.name,
                    "chunk_tokens": tokens_per_chunk,
                    "chunk_bytes": chunk,
                    "dir": medium,
                    "fs": fs,
                    "tokens": length,
                    "chunks": n,
                    "kv_bytes": n * chunk,
                    "status": "ok",
                    "recompute": recompute["lengths"].get(str(length)),
                }
                reason = _skip_reason(case, args)
                if reason:
                    case["status"], case["reason"] = "skipped", reason
                cases.append(case)
    return cases


def _skip_reason(case: dict, args) -> str | None:
    if case["chunks"] == 0:
        return "shorter than one chunk"
    if case["chunk_bytes"] % PAGE:
        return f"chunk of {case['chunk_bytes']} bytes is not whole pages (vLLM's CPU tier needs it)"
    if case["kv_bytes"] > args.max_gib * GiB:
        return f"KV {case['kv_bytes'] / GiB:.1f} GiB > --max-gib {args.max_gib}"
    free = shutil.disk_usage(case["dir"]).free
    need = case["kv_bytes"] + case["chunks"] * 4096 + GiB
    if need > free:
        return f"needs {need / GiB:.1f} GiB on {case['dir']}, {free / GiB:.1f} GiB free"
    return None


def run_shape(shape: Shape, args, torch: Any, payload: Any, result: dict) -> None:
    recompute = measure_recompute(shape, args, torch)
    result["recompute"][shape.name] = recompute
    save(args, result)
    cases = plan_cases(shape, args, recompute)
    result["cases"].extend(cases)
    runnable = [c for c in cases if c["status"] == "ok"]
    if not runnable:
        return
    region = PinnedRegion(
        max(c["kv_bytes"] for c in runnable),
        torch,
        pin=args.device.startswith("cuda"),
        shm=args.shm,
    )
    env = {"torch": torch, "args": args, "shape": shape, "region": region}
    env["sync"] = synchronizer(torch, args.device)
    pinned = region.pinned and bool(region.tensor.is_pinned())  # as torch's copies see it
    result["machine"].setdefault("pinned", {})[shape.name] = pinned
    try:
        for group in _groups(runnable):
            for kind in ("ours", "builtin"):
                run_group(kind, group, env, payload, result)
    finally:
        region.close()


def _groups(cases: list[dict]) -> list[list[dict]]:
    """Cases by (medium, chunk size), in order: one tier instance each."""
    by: dict[tuple[str, int], list[dict]] = {}
    for case in cases:
        by.setdefault((case["dir"], case["chunk_tokens"]), []).append(case)
    return list(by.values())


def run_group(kind: str, group: list[dict], env, payload: Any, result: dict) -> None:
    """One tier instance (a running server) on one medium and chunk size,
    every length of the group through it."""
    args, shape = env["args"], env["shape"]
    if kind == "builtin" and payload is None:
        return
    first = group[0]
    root = os.path.join(first["dir"], f"llmkv-ttft-{os.getpid()}-{kind}")
    os.makedirs(root, exist_ok=True)
    side: Side | None = None
    try:
        if kind == "ours":
            identity = RunIdentity(
                model_name="bench/ttft/" + re.sub(r"[^A-Za-z0-9._-]+", "_", shape.name),
                dtype="bfloat16",
                tokens_per_hash=first["chunk_tokens"],
                blocks_per_file=1,
                kv_cache_groups=((first["chunk_tokens"], ("layers",)),),
            )
            side = OursSide(root, identity, env["region"], first["chunk_bytes"], args)
        else:
            side = BuiltinSide(
                payload, root, env["region"], first["chunk_bytes"], args.builtin_threads
            )
        time.sleep(args.settle_s)  # a running server: workers up, their page tables made
        for case in group:
            if case["status"] == "skipped":
                continue
            if _past_deadline(args):
                case[kind] = {"status": "skipped", "reason": "past --deadline-s"}
                if kind == "ours":
                    case["status"], case["reason"] = "skipped", "past --deadline-s"
                continue
            run_case(side, case, env)
            save(args, result)
    finally:
        if side is not None:
            side.close()
        shutil.rmtree(root, ignore_errors=True)


def _past_deadline(args) -> bool:
    return args.deadline_s is not None and time.monotonic() - args.started > args.deadline_s


# -- output ----------------------------------------------------------------------------------


def save(args, result: dict) -> None:
    result["ok"] = not any(c["status"] == "failed" for c in result["cases"])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)


def describe_machine(args, torch: Any) -> dict[str, Any]:
    info = machine_info(args.dirs)
    info["torch"] = torch.__version__
    info["device"] = args.device
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(args.device)
        info["cuda"] = torch.version.cuda
    try:
        info["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        info["transformers"] = None
    info["filesystems"] = {d: filesystem_type(d) for d in args.dirs}
    return info


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv, (__doc__ or "").split("\n\n")[0])
    args.started = time.monotonic()
    torch = import_torch()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu")
    for d in args.dirs:
        os.makedirs(d, exist_ok=True)
    shapes = [resolve_shape(s) for s in args.shapes]
    payload = None
    if args.builtin:
        from tools.bench.builtin import load_payload

        payload = load_payload(args.builtin)
    result: dict[str, Any] = {
        "not_in_figures": NOT_IN_FIGURES,
        "machine": describe_machine(args, torch),
        "args": {k: v for k, v in vars(args).items() if k != "started"},
        "builtin": payload.manifest if payload else "not run (no --builtin PAYLOAD_DIR)",
        "shapes": {s.name: s.describe() for s in shapes},
        "recompute": {},
        "cases": [],
    }
    m = result["machine"]
    print(
        f"# {platform.node()}: {m.get('gpu', args.device)}, {m['cpus']} CPUs, torch "
        f"{m['torch']}, load {m['load_average']}; built-in: "
        f"{'vLLM ' + payload.manifest['vllm_version'] if payload else 'not run'}"
    )
    print(f"# {NOT_IN_FIGURES}", flush=True)
    for shape in shapes:
        run_shape(shape, args, torch, payload, result)
    result["machine"]["load_average_after"] = os.getloadavg()
    save(args, result)
    print(render_tables(result))
    if args.plot:
        print(f"# plot: {plot(result, args.plot)}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
