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

from llmkv_fs.checks import int_between, option
from llmkv_fs.config import setting_option
from llmkv_fs.harness.demo_replica import TOKENS_PER_CHUNK, DemoError, ReplicaProcess
from llmkv_fs.harness.demo_report import (
    describe,
    print_tally,
    print_volume,
    say,
    volume_summary,
)

VOCAB = 32000
DEFAULT_SEED = "4242"  # PYTHONHASHSEED when the environment sets none
MiB = 1 << 20
_COUNT = option(int_between(1, 1 << 20))  # documents, chunks, requests
_SOME = option(int_between(0, 1 << 20))  # chunks that may be none


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--root",
        help="cache root, e.g. a PVC mount (default: a temporary directory, removed afterwards)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary root")
    p.add_argument(
        "--docs",
        type=_COUNT,
        default=4,
        help="documents (shared prefixes) requests are built on (default 4)",
    )
    p.add_argument(
        "--doc-chunks",
        type=_COUNT,
        default=8,
        help="chunks (16 tokens each) per document (default 8)",
    )
    p.add_argument(
        "--suffix-chunks",
        type=_SOME,
        default=2,
        help="unique chunks after the document in each request (default 2)",
    )
    p.add_argument(
        "--requests",
        type=_COUNT,
        default=8,
        help="requests each of the two first replicas serves (default 8)",
    )
    _add_replica_options(p)
    return p


def _add_replica_options(p: argparse.ArgumentParser) -> None:
    """How each replica's tier and CPU tier are set up."""
    p.add_argument(
        "--block-mib",
        type=option(int_between(1, 1024)),
        default=2,
        help="chunk size in MiB (default 2)",
    )
    p.add_argument(
        "--threads",
        type=setting_option("n_read_threads"),
        default=4,
        help="read and write threads each",
    )
    p.add_argument(
        "--cpu-chunks",
        type=_SOME,
        default=0,
        help="CPU tier size in chunks per replica (default: two requests)",
    )
    p.add_argument(
        "--hash-algo",
        default="sha256",
        choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
        help="vLLM prefix-caching hash algorithm (default sha256)",
    )
    p.add_argument(
        "--seal-key-file",
        metavar="PATH",
        help="seal every block with the key in PATH (seal_key_files, key id 1; "
        "make one with: (umask 077; openssl rand -base64 32 > PATH)); every loaded "
        "byte is still compared",
    )
    p.add_argument("--damage", choices=["bitflip", "trailerless"], help=argparse.SUPPRESS)
    p.add_argument("--accept-trailerless", action="store_true", help=argparse.SUPPRESS)


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
        *(["--seal-key-file", os.path.abspath(args.seal_key_file)] if args.seal_key_file else []),
    ]
    procs = [ReplicaProcess(n, options, env) for n in names]
    for p in procs:
        p.tally = Tally()
        p.info = p.receive_ready()
    wall = time.perf_counter() - started
    for p in procs:
        say(
            f"  replica {p.name}: pid {p.info['pid']}, vLLM imported and tier up in "
            f"{p.info['start_s']:.1f} s; {p.info['hash_algo']} seed fingerprint "
            f"{p.info['fingerprint']}"
        )
    if len(procs) > 1:
        say(f"  ({len(procs)} processes started in parallel: {wall:.1f} s wall)")
    return procs


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
    _check_arguments(args)
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
    _introduce(args, root, seed)
    procs: list[ReplicaProcess] = []
    stored_by: dict[int, str] = {}  # document -> replica that served it first
    try:
        # Phase 1: two replicas, in parallel, taking turns.
        say("\nphase 1: replicas r1 and r2 start in parallel (separate processes)")
        procs = _start(["r1", "r2"], args, root, env)
        _take_turns(procs, work, args, stored_by)
        during = volume_summary(root)
        victim = None
        if args.damage:
            procs[0].send({"cmd": "paths", "tokens": work.doc_tokens(0)})
            # The document's last chunk: a load keeps only the prefix before
            # its first bad block (as vLLM's built-in does), so exactly the
            # damaged chunk is recomputed.
            victim = procs[0].receive("paths")["paths"][args.doc_chunks - 1]
        for p in procs:
            p.tally.counters = p.quit()["counters"]
        say("  r1 and r2 shut down (leases removed)")
        if victim:
            _damage(victim, args.damage, args.block_mib * MiB)
            say(
                f"\n[--damage {args.damage}] altered {os.path.relpath(victim, root)} "
                f"(doc 0, chunk {args.doc_chunks - 1})"
            )

        # Phase 2: a restarted replica, a fresh process, same volume and seed.
        say("\nphase 2: replica r3 (a restarted engine: fresh process, empty CPU tier)")
        (r3,) = _start(["r3"], args, root, env)
        procs.append(r3)
        _serve_every_document(r3, work, args, stored_by)

        say("")
        for p in procs:
            print_tally(p, "restarted, " if p is r3 else "")
        print_volume(root, during)
        ok = _verdict(procs, r3)
        if not made_root or args.keep:
            say(f"(inspect it: llmkv-fs stats {root})")
        return 0 if ok else 1
    except DemoError as exc:
        say(f"\nFAILED: {exc}")
        return 1
    finally:
        for p in procs:
            p.stop()
        if made_root and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse what cannot run; fill in the CPU tier's default size."""
    request_chunks = args.doc_chunks + args.suffix_chunks
    args.cpu_chunks = args.cpu_chunks or 2 * request_chunks
    if args.cpu_chunks < request_chunks:
        raise SystemExit(f"llmkv-fs demo: --cpu-chunks must hold one request ({request_chunks})")


def _introduce(args: argparse.Namespace, root: str, seed: str) -> None:
    say(f"llmkv_fs demo under {root}")
    say(
        f"  {args.docs} documents x {args.doc_chunks} chunks, + {args.suffix_chunks} unique "
        f"chunks per request; chunk = {TOKENS_PER_CHUNK} tokens = {args.block_mib} MiB of KV; "
        f"CPU tier {args.cpu_chunks} chunks per replica; {args.threads} read + "
        f"{args.threads} write threads"
    )
    if args.seal_key_file:
        say(f"  blocks sealed (AES-256-GCM) with the key in {args.seal_key_file}")
    say(
        f"  keys: vLLM's hash_block_tokens chained from NONE_HASH "
        f"({args.hash_algo}, PYTHONHASHSEED={seed}, same in every replica)"
    )


def _take_turns(
    procs: list[ReplicaProcess],
    work: Workload,
    args: argparse.Namespace,
    stored_by: dict[int, str],
) -> None:
    """Phase 1: in each turn both replicas serve one request at once, then
    wait for each other; later turns swap the documents."""
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
            line.append(describe(p.name, r, doc, owner))
        say(f"  turn {turn + 1:>2}  " + "  |  ".join(line))
    say(f"  ({2 * args.requests} requests in {time.perf_counter() - started:.1f} s)")


def _serve_every_document(
    r3: ReplicaProcess, work: Workload, args: argparse.Namespace, stored_by: dict[int, str]
) -> None:
    """Phase 2: the restarted replica serves every document once, then quits."""
    for doc in range(args.docs):
        r3.send({"cmd": "serve", "requests": [work.request(doc, "r3")]})
        reply = r3.receive("served")
        (r,) = reply["results"]
        r3.tally.add(r, cross=True)
        r3.tally.counters = reply["counters"]
        say(f"  request {doc + 1:>2}  " + describe("r3", r, doc, stored_by.get(doc)))
    r3.tally.counters = r3.quit()["counters"]


def _verdict(procs: list[ReplicaProcess], r3: ReplicaProcess) -> bool:
    """Every loaded byte matched and the restarted replica hit; says so."""
    wrong = sum(len(p.tally.mismatched) for p in procs)
    quarantined = sum(p.tally.counters.get("quarantined", 0) for p in procs)
    ok = wrong == 0 and r3.tally.hits > 0
    say("")
    if wrong:
        say(f"FAILED: {wrong} loaded chunk(s) did not match the bytes stored for their key")
        for p in procs:
            for key in p.tally.mismatched[:5]:
                say(f"  {p.name} loaded wrong bytes for key {key}")
    if r3.tally.hits == 0:
        say("FAILED: the restarted replica found nothing on the volume")
    if ok:
        caught = f"; {quarantined} damaged file(s) quarantined, never served" if quarantined else ""
        say(
            f"OK: every loaded byte matched; r2 hit {procs[1].tally.hit_other} chunks "
            f"r1 stored, r1 hit {procs[0].tally.hit_other} r2 stored; the restarted "
            f"replica hit {r3.tally.hit_rate:.1f}%{caught}."
        )
    return ok
