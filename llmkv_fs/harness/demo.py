"""``llmkv-fs demo``: vLLM replicas in separate processes share KV chunks
through llmkv_fs.

A handful of "documents" (system prompts, ``--doc-chunks`` chunks of 16
tokens each) are served as requests of document + unique suffix. Two
replicas -- separate processes (``llmkv_fs.harness.demo_replica``), same
``PYTHONHASHSEED``, vLLM's real scheduler-side ``TieringOffloadingManager``
with llmkv_fs as its secondary tier -- take turns in parallel: in each turn
both serve one request, then wait for each other, so the later turns find on
the volume the prefixes the other replica stored. Keys are vLLM's block
hashes of the token ids; every chunk that hits is read back from the CPU tier
and compared byte for byte with the payload of its key; the rest are
"computed" and stored. Then both exit and a restarted replica (a fresh
process) serves every document once more and finds them on the volume. Needs
no GPU; the parent process never imports vLLM.

Exit status 0 only if every loaded byte matched, no replica failed and the
restarted replica hit. A hidden ``--damage`` flag alters one stored block of
document 0 on disk between the phases: ``bitflip`` (the tier must catch it,
quarantine it and recompute; still exit 0) or ``trailerless`` (a vLLM-format
file without our trailer, content altered: the tier accepts such files
unverified, so the demo's own byte check must catch it; exit 1).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from llmkv_fs.harness.demo_replica import TOKENS_PER_CHUNK, DemoError, ReplicaProcess
from llmkv_fs.ops.stats import volume_stats

VOCAB = 32000
DEFAULT_SEED = "4242"  # PYTHONHASHSEED when the environment sets none
MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--root",
        help="cache root, e.g. a PVC mount (default: a temporary directory, removed afterwards)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary root")
    p.add_argument(
        "--docs",
        type=int,
        default=4,
        help="documents (shared prefixes) requests are built on (default 4)",
    )
    p.add_argument(
        "--doc-chunks", type=int, default=8, help="chunks (16 tokens each) per document (default 8)"
    )
    p.add_argument(
        "--suffix-chunks",
        type=int,
        default=2,
        help="unique chunks after the document in each request (default 2)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=8,
        help="requests each of the two first replicas serves (default 8)",
    )
    p.add_argument("--block-mib", type=int, default=2, help="chunk size in MiB (default 2)")
    p.add_argument("--threads", type=int, default=4, help="read and write threads each")
    p.add_argument(
        "--cpu-chunks",
        type=int,
        default=0,
        help="CPU tier size in chunks per replica (default: two requests)",
    )
    p.add_argument(
        "--hash-algo",
        default="sha256",
        choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
        help="vLLM prefix-caching hash algorithm (default sha256)",
    )
    p.add_argument("--damage", choices=["bitflip", "trailerless"], help=argparse.SUPPRESS)
    p.add_argument("--accept-trailerless", action="store_true", help=argparse.SUPPRESS)
    return p


def _say(text: str = "") -> None:
    print(text, flush=True)


# -- the workload ------------------------------------------------------------------


@dataclass
class Workload:
    docs: int
    doc_chunks: int
    suffix_chunks: int
    _serial: int = 0

    def doc_tokens(self, doc: int) -> list[int]:
        rng = random.Random(f"llmkv-fs demo document {doc}")
        return [rng.randrange(VOCAB) for _ in range(self.doc_chunks * TOKENS_PER_CHUNK)]

    def request(self, doc: int, who: str) -> dict[str, Any]:
        """Document ``doc`` + a suffix no other request has."""
        self._serial += 1
        rng = random.Random(f"llmkv-fs demo request {who} {self._serial}")
        suffix = [rng.randrange(VOCAB) for _ in range(self.suffix_chunks * TOKENS_PER_CHUNK)]
        return {"id": f"{who}-{self._serial}", "doc": doc, "tokens": self.doc_tokens(doc) + suffix}


# -- replica processes -------------------------------------------------------------


@dataclass
class Tally:
    requests: int = 0
    chunks: int = 0
    hit_cpu: int = 0
    hit_fs: int = 0
    hit_other: int = 0  # volume hits on documents another replica stored first
    stored: int = 0
    mismatched: list[str] = field(default_factory=list)
    bad_bytes: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    store_bytes: int = 0
    store_s: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)

    def add(self, r: dict[str, Any], cross: bool) -> None:
        self.requests += 1
        self.chunks += r["chunks"]
        self.hit_cpu += r["hit_cpu"]
        self.hit_fs += r["hit_fs"]
        self.hit_other += r["hit_fs"] if cross else 0
        self.stored += r["stored"]
        self.mismatched += r["mismatched"]
        self.bad_bytes += r["bad_bytes"]
        if r["delta"]["bytes_read"]:
            self.load_bytes += r["delta"]["bytes_read"]
            self.load_s += r["find_s"]
        if r["delta"]["bytes_written"]:
            self.store_bytes += r["delta"]["bytes_written"]
            self.store_s += r["store_s"]

    @property
    def hits(self) -> int:
        return self.hit_cpu + self.hit_fs

    @property
    def hit_rate(self) -> float:
        return 100.0 * self.hits / self.chunks if self.chunks else 0.0


def _start(names: list[str], args, root, env) -> list[ReplicaProcess]:
    started = time.perf_counter()
    options = [
        "--root",
        root,
        "--block-bytes",
        str(args.block_mib * MiB),
        "--cpu-chunks",
        str(args.cpu_chunks),
        "--threads",
        str(args.threads),
        "--hash-algo",
        args.hash_algo,
        *(["--accept-trailerless"] if args.accept_trailerless else []),
    ]
    procs = [ReplicaProcess(n, options, env) for n in names]
    for p in procs:
        p.tally = Tally()
        p.info = p.receive_ready()
    wall = time.perf_counter() - started
    for p in procs:
        _say(
            f"  replica {p.name}: pid {p.info['pid']}, vLLM imported and tier up in "
            f"{p.info['start_s']:.1f} s; {p.info['hash_algo']} seed fingerprint "
            f"{p.info['fingerprint']}"
        )
    if len(procs) > 1:
        _say(f"  ({len(procs)} processes started in parallel: {wall:.1f} s wall)")
    return procs


# -- reporting ---------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    return f"{n / MiB:.1f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 and nbytes else "-"


def _describe(name: str, r: dict[str, Any], doc: int, stored_by: str | None) -> str:
    hits = r["hit_cpu"] + r["hit_fs"]
    src = []
    if r["hit_cpu"]:
        src.append(f"{r['hit_cpu']} CPU tier")
    if r["hit_fs"]:
        src.append(
            f"{r['hit_fs']} volume"
            + (f", stored by {stored_by}" if stored_by and stored_by != name else "")
        )
    bad = f", {len(r['mismatched'])} WRONG" if r["mismatched"] else ""
    where = f" ({'; '.join(src)})" if src else ""
    return f"{name}: doc {doc} {hits:>2}/{r['chunks']} hit{where}, {r['miss']} computed{bad}"


def _print_tally(p: ReplicaProcess, label: str = "") -> None:
    t, c = p.tally, p.tally.counters
    _say(
        f"replica {p.name} ({label}pid {p.info.get('pid')}): {t.requests} requests, "
        f"{t.chunks} chunks looked up, {t.hits} hits ({t.hit_cpu} from its CPU tier, "
        f"{t.hit_fs} from the volume, {t.hit_other} of them stored by another replica) "
        f"= {t.hit_rate:.1f}% hit rate"
    )
    verdict = (
        f"all {t.hits} loaded chunks byte-exact"
        if not t.mismatched
        else f"{len(t.mismatched)} loaded chunks WRONG ({t.bad_bytes} bytes differ)"
    )
    _say(
        f"  loads  {_fmt_bytes(t.load_bytes)} volume->CPU at {_rate(t.load_bytes, t.load_s)}"
        f" (lookup to HIT, wall); stores {_fmt_bytes(t.store_bytes)} CPU->volume at "
        f"{_rate(t.store_bytes, t.store_s)} (until published, wall)"
    )
    corrupt = {k: v for k, v in c.items() if k.startswith("load_corrupt_") and v}
    _say(
        f"  {verdict}; tier: {c.get('blocks_verified', 0)} verified, "
        f"{c.get('blocks_unverified', 0)} unverified (trailer-less) loads, "
        f"{c.get('blocks_written', 0)} written, {c.get('blocks_present', 0)} already present, "
        f"{c.get('quarantined', 0)} quarantined{' ' + str(corrupt) if corrupt else ''}"
    )


def _volume_summary(root: str) -> dict[str, Any]:
    report = volume_stats(root, threads=2)
    return {
        "source": "llmkv_fs.ops.stats",
        "digests": [
            {
                "name": d["name"],
                "blocks": d["blocks"],
                "bytes": d["bytes"],
                "chunk": d["chunk_bytes"],
                "quarantined": d["quarantined"]["count"],
                "reasons": d["quarantined"]["reasons"],
                "temp": d["temp"]["count"],
                "live": len(d["leases"]["live"]),
                "stale": len(d["leases"]["stale"]),
                "seeds": d["seed_fingerprints"],
            }
            for d in report["digests"]
        ],
        "warnings": report["warnings"],
    }


def _print_volume(root: str, during: dict[str, Any] | None) -> None:
    summary = _volume_summary(root)
    _say(f"\non the volume ({root}, via {summary['source']}):")
    for d in summary["digests"]:
        reasons = ", ".join(f"{k} {n}" for k, n in d["reasons"].items())
        _say(
            f"  {d['name']}/: {d['blocks']} blocks, {_fmt_bytes(d['bytes'])}"
            f"{' (' + _fmt_bytes(d['chunk']) + ' chunks + 4 KiB trailer)' if d['chunk'] else ''}"
            f"; {d['quarantined']} quarantined{' (' + reasons + ')' if reasons else ''}; "
            f"{d['temp']} temp files; leases now {d['live']} live, {d['stale']} stale"
        )
    if during:
        for d in during["digests"]:
            _say(
                f"  while replicas 1 and 2 ran: {d['live']} live leases on {d['name']}, "
                f"seed fingerprints {d['seeds'] or '(n/a)'}"
                f"{' -- they agree' if len(d['seeds']) == 1 and d['live'] > 1 else ''}"
            )
    for w in summary["warnings"] + (during or {}).get("warnings", []):
        _say(f"  !!! {w}")


def _damage(path: str, how: str, block_bytes: int) -> None:
    """Alter a real block file between the phases (hidden --damage)."""
    with open(path, "r+b") as f:
        f.seek(block_bytes // 3)
        byte = f.read(1)[0]
        f.seek(block_bytes // 3)
        f.write(bytes([byte ^ 0x10]))  # one flipped bit in the payload
        if how == "trailerless":
            f.truncate(block_bytes)  # drop our trailer: what vLLM's built-in tier writes


# -- the demo ----------------------------------------------------------------------


def run_demo(args: argparse.Namespace) -> int:
    for flag in ("docs", "doc_chunks", "requests", "block_mib", "threads"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"llmkv-fs demo: --{flag.replace('_', '-')} must be >= 1")
    if args.suffix_chunks < 0:
        raise SystemExit("llmkv-fs demo: --suffix-chunks must be >= 0")
    request_chunks = args.doc_chunks + args.suffix_chunks
    args.cpu_chunks = args.cpu_chunks or 2 * request_chunks
    if args.cpu_chunks < request_chunks:
        raise SystemExit(f"llmkv-fs demo: --cpu-chunks must hold one request ({request_chunks})")
    made_root = args.root is None
    root = tempfile.mkdtemp(prefix="llmkv_fs_demo_") if made_root else os.path.abspath(args.root)
    os.makedirs(root, exist_ok=True)
    seed = os.environ.get("PYTHONHASHSEED") or DEFAULT_SEED
    env = {
        **os.environ,
        "PYTHONHASHSEED": seed,
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    work = Workload(args.docs, args.doc_chunks, args.suffix_chunks)
    block_bytes = args.block_mib * MiB

    _say(f"llmkv_fs demo under {root}")
    _say(
        f"  {args.docs} documents x {args.doc_chunks} chunks, + {args.suffix_chunks} unique "
        f"chunks per request; chunk = {TOKENS_PER_CHUNK} tokens = {args.block_mib} MiB of KV; "
        f"CPU tier {args.cpu_chunks} chunks per replica; {args.threads} read + "
        f"{args.threads} write threads"
    )
    _say(
        f"  keys: vLLM's hash_block_tokens chained from NONE_HASH "
        f"({args.hash_algo}, PYTHONHASHSEED={seed}, same in every replica)"
    )
    procs: list[ReplicaProcess] = []
    stored_by: dict[int, str] = {}  # document -> replica that served it first
    ok = True
    try:
        # Phase 1: two replicas, in parallel, taking turns.
        _say("\nphase 1: replicas r1 and r2 start in parallel (separate processes)")
        procs = _start(["r1", "r2"], args, root, env)
        started = time.perf_counter()
        half = max(1, args.docs // 2)
        for turn in range(args.requests):
            docs = [turn % args.docs, (turn + half) % args.docs]
            reqs = [work.request(d, p.name) for d, p in zip(docs, procs)]
            for p, req in zip(procs, reqs):  # both serve at once ...
                p.send({"cmd": "serve", "requests": [req]})
            line = []
            for p, doc in zip(procs, docs):  # ... then wait for each other
                reply = p.receive("served")
                (r,) = reply["results"]
                if doc not in stored_by:  # found at first sight: a reused --root
                    computed = r["hit_cpu"] + r["hit_fs"] < args.doc_chunks
                    stored_by[doc] = p.name if computed else "an earlier run"
                owner = stored_by[doc]
                p.tally.add(r, cross=owner != p.name)
                p.tally.counters = reply["counters"]
                line.append(_describe(p.name, r, doc, owner))
            _say(f"  turn {turn + 1:>2}  " + "  |  ".join(line))
        _say(f"  ({2 * args.requests} requests in {time.perf_counter() - started:.1f} s)")
        during = _volume_summary(root)
        victim = None
        if args.damage:
            procs[0].send({"cmd": "paths", "tokens": work.doc_tokens(0)})
            victim = procs[0].receive("paths")["paths"][args.doc_chunks // 2]
        for p in procs:
            p.tally.counters = p.quit()["counters"]
        _say("  r1 and r2 shut down (leases removed)")
        if victim:
            _damage(victim, args.damage, block_bytes)
            _say(
                f"\n[--damage {args.damage}] altered {os.path.relpath(victim, root)} "
                f"(doc 0, chunk {args.doc_chunks // 2})"
            )

        # Phase 2: a restarted replica, a fresh process, same volume and seed.
        _say("\nphase 2: replica r3 (a restarted engine: fresh process, empty CPU tier)")
        (r3,) = _start(["r3"], args, root, env)
        procs.append(r3)
        for doc in range(args.docs):
            r3.send({"cmd": "serve", "requests": [work.request(doc, "r3")]})
            reply = r3.receive("served")
            (r,) = reply["results"]
            r3.tally.add(r, cross=True)
            r3.tally.counters = reply["counters"]
            _say(f"  request {doc + 1:>2}  " + _describe("r3", r, doc, stored_by.get(doc)))
        r3.tally.counters = r3.quit()["counters"]

        _say("")
        for p in procs:
            _print_tally(p, "restarted, " if p is r3 else "")
        _print_volume(root, during)
        wrong = sum(len(p.tally.mismatched) for p in procs)
        quarantined = sum(p.tally.counters.get("quarantined", 0) for p in procs)
        ok = wrong == 0 and r3.tally.hits > 0
        _say("")
        if wrong:
            _say(f"FAILED: {wrong} loaded chunk(s) did not match the bytes stored for their key")
            for p in procs:
                for key in p.tally.mismatched[:5]:
                    _say(f"  {p.name} loaded wrong bytes for key {key}")
        if r3.tally.hits == 0:
            _say("FAILED: the restarted replica found nothing on the volume")
        if ok:
            caught = (
                f"; {quarantined} damaged file(s) quarantined, never served" if quarantined else ""
            )
            _say(
                f"OK: every loaded byte matched; r2 hit {procs[1].tally.hit_other} chunks "
                f"r1 stored, r1 hit {procs[0].tally.hit_other} r2 stored; the restarted "
                f"replica hit {r3.tally.hit_rate:.1f}%{caught}."
            )
        if not made_root or args.keep:
            _say(f"(inspect it: llmkv-fs stats {root})")
        return 0 if ok else 1
    except DemoError as exc:
        _say(f"\nFAILED: {exc}")
        return 1
    finally:
        for p in procs:
            p.stop()
        if made_root and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
