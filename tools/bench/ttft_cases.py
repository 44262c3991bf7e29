"""One case of tools/bench/ttft.py measured on one side (a shape, a chunk
size, a medium, a prompt length): the prompt's KV stored, then ``--rounds``
timed hits (lookups, one promotion job of every chunk, the rows copied to
the GPU), every byte compared; on media with a page cache, a plain parallel
read of the same files as the reference for the load's GB/s.

Threads: the run's thread drives the side; only ``plain_read`` starts
threads of its own (``preadv`` releases the GIL) and joins them before it
returns."""

from __future__ import annotations

import itertools
import mmap
import os
import statistics
import threading
import time
from typing import Any

from tools.bench.support import make_keys
from tools.bench.ttft_plot import case_line
from tools.bench.ttft_recompute import free_memory, is_oom
from tools.bench.ttft_sides import (
    CaseFailed,
    Side,
    lookup_until_known,
    next_job_id,
    store_all,
    wait_jobs,
)

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def drop_page_cache(paths: list[str], fs: str) -> str:
    """Write back and drop the files' cached pages (posix_fadvise DONTNEED:
    no root needed). tmpfs has nothing to drop: its files are page cache."""
    if fs in ("tmpfs", "ramfs"):
        return f"not droppable ({fs})"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "dropped (posix_fadvise DONTNEED per file)"


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def compare(torch: Any, got: Any, want: Any, what: str) -> None:
    """Every byte equal, else CaseFailed naming the chunks that differ
    (found a slice of rows at a time: no full-size mask on the GPU)."""
    if torch.equal(got, want):
        return
    bad: list[int] = []
    step = max(1, (256 * MiB) // max(1, got.shape[1]))
    for lo in range(0, got.shape[0], step):
        rows = (got[lo : lo + step] != want[lo : lo + step]).any(dim=1).nonzero().flatten()
        bad += [lo + int(i) for i in rows.tolist()]
    raise CaseFailed(f"{what}: {len(bad)} chunk(s) differ, first {bad[:5]}")


def timed_round(side: Side, keys: list[bytes], host: Any, dev: Any, want: Any, env) -> dict:
    """One hit: lookups, one promotion job of every chunk, the rows to the
    GPU; timed as a whole and by part, then every byte compared."""
    torch, args, sync = env["torch"], env["args"], env["sync"]
    request, job = f"ttft-{next_job_id()}", next_job_id()
    clock = time.perf_counter
    t0 = clock()
    steps = lookup_until_known(side, keys, request, args)
    t1 = clock()
    if not side.tier.submit_load(job, keys, list(range(len(keys)))):
        raise CaseFailed(f"{side.name}: load job refused")
    wait_jobs(side, {job}, args.poll_s, time.monotonic() + args.job_deadline_s, "load")
    t2 = clock()
    dev.copy_(host, non_blocking=True)
    sync()
    t3 = clock()
    side.forget(request)
    compare(torch, dev, want, f"{side.name}: loaded bytes")
    return {
        "lookup_s": t1 - t0,
        "load_s": t2 - t1,
        "copy_s": t3 - t2,
        "total_s": t3 - t0,
        "steps": steps,
    }


def plain_read(paths: list[str], view: memoryview, chunk: int, threads: int, direct: bool) -> float:
    """Read the first ``chunk`` bytes of each file into its row, ``threads``
    threads taking files in turn (preadv releases the GIL)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    counter = itertools.count()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            while (i := next(counter)) < len(paths):
                fd = os.open(paths[i], flags)
                try:
                    row, done = view[i * chunk : (i + 1) * chunk], 0
                    while done < chunk:
                        got = os.preadv(fd, [row[done:]], done)
                        if got <= 0:
                            raise OSError(f"{paths[i]}: short file")
                        done += got
                finally:
                    os.close(fd)
        except BaseException as exc:
            errors.append(exc)

    t = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t


def measure_side(side: Side, case: dict, keys: list[bytes], env) -> dict:
    """Store, then ``--rounds`` timed hits after dropping the page cache
    and zeroing the rows; medians, and ours' plain-read reference."""
    torch, args = env["torch"], env["args"]
    n, chunk = case["chunks"], case["chunk_bytes"]
    host, region = env["region"].rows(n, chunk), env["region"]
    want = env["want"]
    host.copy_(want)
    env["sync"]()
    per_job = max(1, args.store_job_tokens // case["chunk_tokens"])
    out: dict[str, Any] = {"status": "ok", "info": side.info, "rounds": []}
    out["store_s"] = store_all(side, keys, per_job, args)
    out["store_gbps"] = case["kv_bytes"] / out["store_s"] / 1e9
    paths = [side.path(k) for k in keys]
    if args.tamper:
        flip_byte(paths[len(paths) // 2], chunk // 2)
    dev = torch.zeros_like(want)  # the KV cache's pages exist before the timed copy
    for _ in range(args.rounds):
        out["page_cache"] = drop_page_cache(paths, case["fs"])
        host.zero_()
        out["rounds"].append(timed_round(side, keys, host, dev, want, env))
    for k in ("lookup_s", "load_s", "copy_s", "total_s", "steps"):
        out[k] = statistics.median(r[k] for r in out["rounds"])
    out["load_gbps"] = case["kv_bytes"] / out["load_s"] / 1e9
    if side.name == "ours" and not out["page_cache"].startswith("not"):
        case["plain_read"] = reference_read(paths, region, host, dev, want, case, env)
    return out


def reference_read(paths, region, host, dev, want, case, env) -> dict:
    """A plain parallel read of the same files, the page cache dropped
    first, at each thread count and with/without O_DIRECT; the best is the
    reference."""
    torch, args = env["torch"], env["args"]
    chunk = case["chunk_bytes"]
    modes = [True, False] if chunk % PAGE == 0 and hasattr(os, "O_DIRECT") else [False]
    samples = []
    with memoryview(region.mm) as view:
        for direct in modes:
            for threads in args.read_threads:
                drop_page_cache(paths, case["fs"])
                host.zero_()
                try:
                    s = plain_read(paths, view, chunk, threads, direct)
                except OSError as exc:  # O_DIRECT refused: the buffered read stands
                    samples.append({"o_direct": direct, "threads": threads, "error": str(exc)})
                    continue
                dev.copy_(host)
                compare(torch, dev, want, "plain read")
                gbps = case["kv_bytes"] / s / 1e9
                samples.append({"o_direct": direct, "threads": threads, "s": s, "gbps": gbps})
    best = max((x for x in samples if "gbps" in x), key=lambda x: x["gbps"], default=None)
    return {"samples": samples, "best": best, "gbps": best["gbps"] if best else None}


def run_case(side: Side, case: dict, env) -> None:
    """Measure one case on one side into ``case[side.name]``: a failure or
    an out-of-memory is recorded there (the run goes on), the side's files
    are removed either way."""
    torch, args = env["torch"], env["args"]
    n, chunk, shape = case["chunks"], case["chunk_bytes"], env["shape"]
    gen = torch.Generator(device=args.device).manual_seed(case["tokens"] + chunk)
    keys = make_keys(n, f"ttft-{os.getpid()}-{side.name}-{shape.name}-{chunk}-{case['tokens']}")
    try:
        env["want"] = torch.randint(
            0, 256, (n, chunk), dtype=torch.uint8, device=args.device, generator=gen
        )
        # The bytes are the prompt's KV as vLLM's CPU tier holds a chunk:
        # [layer][K, V][token][KV head][head dim], bf16.
        env["want"].view(torch.bfloat16).view(
            n, shape.layers, 2, case["chunk_tokens"], shape.kv_heads, shape.head_dim
        )
        case[side.name] = measure_side(side, case, keys, env)
    except CaseFailed as exc:
        case[side.name] = {"status": "failed", "reason": str(exc)}
        case["reason"] = "; ".join(filter(None, [case.get("reason"), str(exc)]))
        case["status"] = "failed"
    except Exception as exc:
        if not is_oom(torch, exc):
            raise
        case[side.name] = {"status": "oom", "reason": str(exc).splitlines()[0]}
    finally:
        env.pop("want", None)
        free_memory(torch, args.device)
        _remove_files(side, keys)
        case["load_average"] = os.getloadavg()
    print("# " + case_line(case, side.name), flush=True)


def _remove_files(side: Side, keys: list[bytes]) -> None:
    for key in keys:
        try:
            os.unlink(side.path(key))
        except OSError:
            pass
