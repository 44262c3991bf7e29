"""``llmkv-fs demo``: two vLLM engines share KV blocks through llmkv_fs.

Replica A stores a prompt's KV chunks through vLLM's real tiering manager
(the CPU-tier write stands in for the GPU copy); replica B -- another engine
id, same root -- finds them (RETRY -> HIT_PENDING -> HIT) and promotes them
byte-exact into its CPU tier; then one file is damaged and replica C shows
it is caught, quarantined and treated as a miss. Needs no GPU.
"""

from __future__ import annotations

import collections
import glob
import os
import shutil
import tempfile
import time

from llmkv_fs.tier.driver import MiB, Replica, make_keys, offloading_config, ours, payload_for


def _replica(name: str, root: str, blocks: int, block_bytes: int, threads: int) -> Replica:
    config = offloading_config(
        tiers=[ours(root, n_read_threads=threads, n_write_threads=threads)],
        block_bytes=block_bytes,
        cpu_bytes=(blocks + 8) * block_bytes,
        engine_id=f"llmkv_demo_{name}_{os.getpid()}",
    )
    return Replica(config)


def _collapse_steps(history) -> list[tuple[int, int, str]]:
    """Runs of identical per-step verdict counts, as (first, last, text)."""
    runs: list[tuple[int, int, str]] = []
    for step, results in enumerate(history):
        counts = collections.Counter(r.name for r in results)
        text = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
        if runs and runs[-1][2] == text:
            runs[-1] = (runs[-1][0], step, text)
        else:
            runs.append((step, step, text))
    return runs


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"


def run_demo(root: str | None, blocks: int, block_mib: int, threads: int, keep: bool) -> int:
    made_root = root is None
    root = root or tempfile.mkdtemp(prefix="llmkv_fs_demo_")
    block_bytes = block_mib * MiB
    keys = make_keys(blocks, seed="demo: the same system prompt on every replica")
    print(f"llmkv_fs demo: {blocks} chunks of {block_mib} MiB under {root}")
    replicas: list[Replica] = []
    ok = True
    try:
        a = _replica("a", root, blocks, block_bytes, threads)
        replicas.append(a)
        started = time.perf_counter()
        a.store(keys)
        stored_s = time.perf_counter() - started
        files = sorted(glob.glob(f"{root}/*_r*/*/*/*.bin"))
        print(f"\n[replica A] stored {len(files)} chunks in {stored_s * 1e3:.0f} ms "
              f"({_rate(len(files) * block_bytes, stored_s)}, {threads} write threads)")
        print(f"  layout : {a.tier.layout.config_path}")
        print(f"           {os.path.relpath(files[0], root)} (+{len(files) - 1} more)")
        print(f"  a file : {os.path.getsize(files[0])} bytes = {block_bytes} payload "
              f"+ 4096 trailer (magic, length, key, xxh3)")

        b = _replica("b", root, blocks, block_bytes, threads)
        replicas.append(b)
        ctx = b.new_request()
        started = time.perf_counter()
        final, history = b.find(keys, ctx)
        found_s = time.perf_counter() - started
        print("\n[replica B] another engine, same root: lookups step by step")
        for first, last, summary in _collapse_steps(history):
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            print(f"  {steps:>12}: {summary}")
        exact = sum(b.read_primary(k, ctx) == payload_for(k, b.row_bytes) for k in keys)
        ok &= exact == blocks
        print(f"  promoted {exact}/{blocks} chunks byte-exact into B's CPU tier in "
              f"{found_s * 1e3:.0f} ms ({_rate(blocks * block_bytes, found_s)} incl. steps)")
        print(f"  engine counters: {dict(sorted(b.tier.engine.counters.items()))}")

        victim = a.tier.layout.block_path(keys[blocks // 2])
        with open(victim, "r+b") as f:  # one flipped bit, same size
            f.seek(block_bytes // 3)
            byte = f.read(1)[0]
            f.seek(block_bytes // 3)
            f.write(bytes([byte ^ 1]))
        c = _replica("c", root, blocks, block_bytes, threads)
        replicas.append(c)
        final, _ = c.find(keys)
        misses = [k for k, v in final.items() if v.name == "MISS"]
        quarantined = glob.glob(f"{c.tier.layout.quarantine_dir}/*")
        ok &= misses == [keys[blocks // 2]] and len(quarantined) == 1
        print("\n[replica C] after flipping one bit in one file:")
        print(f"  {blocks - len(misses)} HIT, {len(misses)} MISS (recomputed, never served); "
              f"quarantined: {[os.path.basename(q) for q in quarantined]}")
        print(f"\n{'OK' if ok else 'FAILED'}: blocks stored once, found by other engines, "
              f"damage caught.")
        return 0 if ok else 1
    finally:
        for replica in replicas:
            replica.close()
        if made_root and not keep:
            shutil.rmtree(root, ignore_errors=True)
