"""One replica of ``llmkv-fs demo``, in its own process: the child
(``ReplicaServer``, ``main``) and the parent's handle on it (``ReplicaProcess``,
stdlib only, so the parent never imports vLLM).

``python -m llmkv_fs.harness.demo_replica --name r1 --root DIR ...`` imports
vLLM, derives ``NONE_HASH`` with vLLM's ``init_none_hash`` (from
``PYTHONHASHSEED`` and ``--hash-algo``), builds vLLM's real scheduler-side
``TieringOffloadingManager`` with llmkv_fs as its secondary tier (see
``driver.Replica``) and then serves requests the parent sends.

Protocol: one JSON object per line. Commands arrive on stdin; replies go to
the process's original stdout, which is set aside before vLLM is imported
(file descriptor 1 then points at stderr, so nothing vLLM or torch prints can
corrupt the protocol). Replies: ``ready`` once, then one reply per command
(``served``, ``paths``, ``bye``), or ``error`` and exit status 1.

Serving a request (token ids): its keys are vLLM's block hashes of the
tokens (``hash_block_tokens`` chained from ``NONE_HASH``, one per 16-token
chunk, packed with ``make_offload_key``), so equal prefixes give equal keys in
every process with the same seed. Every key is looked up through the manager
step by step until HIT or MISS; hits are read out of the CPU tier through
``prepare_load`` and compared byte for byte with the deterministic payload of
their key; misses are "computed" (the payload written into the CPU rows where
the GPU->CPU copy would land) and stored, which cascades them to the tier.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from llmkv_fs.engine import CounterKey, Direction, Failure, Outcome, Tally
from llmkv_fs.layout.blockfile import Corruption

TOKENS_PER_CHUNK = 16  # driver.offloading_config: 16 tokens per block hash, 1 hash per chunk
START_TIMEOUT_S = 600.0  # importing vLLM takes ~10 s idle, minutes on a loaded box
COMMAND_TIMEOUT_S = 300.0

# The engine's counters the demo reports, by the names its JSON protocol uses.
_COUNTERS: dict[str, CounterKey] = {
    "bytes_read": Tally.BYTES_READ,
    "bytes_written": Tally.BYTES_WRITTEN,
    "blocks_verified": Outcome.VERIFIED,
    "blocks_unverified": Outcome.UNVERIFIED,
    "blocks_written": Outcome.WRITTEN,
    "blocks_present": Outcome.PRESENT,
    "quarantined": Tally.QUARANTINED,
    "load_missing": (Direction.LOAD, Failure.MISSING),
}


class DemoError(Exception):
    pass


# -- parent side (stdlib only: the parent never imports vLLM) -----------------------


class ReplicaProcess:
    """Parent side: a ``python -m llmkv_fs.harness.demo_replica`` child and its protocol."""

    def __init__(self, name: str, options: list[str], env: dict[str, str]):
        self.name = name
        self.info: dict[str, Any] = {}
        self.tally: Any = None  # the parent's bookkeeping
        cmd = [sys.executable, "-m", "llmkv_fs.harness.demo_replica", "--name", name, *options]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        stdin, stdout, stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        assert stdin is not None and stdout is not None and stderr is not None  # all PIPE
        self._stdin, self._stdout, self._stderr = stdin, stdout, stderr
        self.stderr: collections.deque[str] = collections.deque(maxlen=60)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump_replies, daemon=True).start()
        threading.Thread(target=self._pump_stderr, daemon=True).start()

    def _pump_replies(self) -> None:
        for line in self._stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:
                self.stderr.append(f"(protocol) {line.rstrip()}")
        self._replies.put(None)  # EOF

    def _pump_stderr(self) -> None:
        for line in self._stderr:
            self.stderr.append(line.rstrip())

    def send(self, cmd: dict[str, Any]) -> None:
        try:
            self._stdin.write(json.dumps(cmd) + "\n")
            self._stdin.flush()
        except OSError as exc:
            raise DemoError(self._failure(f"cannot send {cmd['cmd']}: {exc}")) from exc

    def receive(self, event: str, timeout: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise DemoError(self._failure(f"no {event!r} reply within {timeout:.0f} s")) from None
        if reply is None:
            raise DemoError(self._failure(f"exited (status {self.proc.wait()}) before {event!r}"))
        if reply.get("event") == "error":
            raise DemoError(self._failure(reply["message"], reply.get("traceback", "")))
        if reply.get("event") != event:
            raise DemoError(self._failure(f"expected {event!r}, got {reply.get('event')!r}"))
        return reply

    def receive_ready(self) -> dict[str, Any]:
        return self.receive("ready", START_TIMEOUT_S)

    def _failure(self, what: str, detail: str = "") -> str:
        tail = "\n".join(f"    {line}" for line in list(self.stderr)[-25:])
        return (
            f"replica {self.name} (pid {self.proc.pid}): {what}\n{detail}"
            f"  its last stderr lines:\n{tail or '    (none)'}"
        )

    def quit(self) -> dict[str, Any]:
        self.send({"cmd": "quit"})
        bye = self.receive("bye")
        self._stdin.close()
        self.proc.wait(timeout=COMMAND_TIMEOUT_S)
        return bye

    def stop(self) -> None:
        """Cleanup for a child still running after a failure (ours, by pid)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- child side ---------------------------------------------------------------------


class ReplicaServer:
    def __init__(self, args: argparse.Namespace):
        import numpy as np
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.kv_offload.base import LookupResult, make_offload_key

        from llmkv_fs.harness import driver
        from llmkv_fs.tier.hashing import hashing_identity

        self.np, self.driver, self.kv_cache_utils = np, driver, kv_cache_utils
        self.HIT, self.make_offload_key = LookupResult.HIT, make_offload_key
        # What vLLM's EngineCore does at start-up; the tier's lease reads the
        # algorithm from LLMKV_FS_HASH_ALGO when no VllmConfig is current.
        os.environ["LLMKV_FS_HASH_ALGO"] = args.hash_algo
        self.hash_fn = get_hash_fn_by_name(args.hash_algo)
        kv_cache_utils.init_none_hash(self.hash_fn)
        self.hash_algo, self.fingerprint = hashing_identity()
        config = driver.offloading_config(
            tiers=[
                driver.ours(
                    args.root,
                    n_read_threads=args.threads,
                    n_write_threads=args.threads,
                    accept_trailerless=args.accept_trailerless,
                    **({"seal_key_files": {"1": args.seal_key_file}} if args.seal_key_file else {}),
                )
            ],
            block_bytes=args.block_bytes,
            cpu_bytes=args.cpu_chunks * args.block_bytes,
            engine_id=f"llmkv_demo_{args.name}_{os.getpid()}",
        )
        self.replica = driver.Replica(config)
        self.replica.step()  # the tier writes its lease at its first scheduling step
        self.row_bytes = self.replica.row_bytes

    # -- keys ------------------------------------------------------------------------

    def keys_for(self, tokens: list[int]) -> list[bytes]:
        """vLLM's block hashes of the full 16-token chunks, as offload keys (group 0)."""
        keys, parent = [], None
        for start in range(0, len(tokens) - TOKENS_PER_CHUNK + 1, TOKENS_PER_CHUNK):
            parent = self.kv_cache_utils.hash_block_tokens(
                self.hash_fn, parent, tokens[start : start + TOKENS_PER_CHUNK]
            )
            keys.append(self.make_offload_key(parent, 0))
        return keys

    def counters(self) -> dict[str, int]:
        c = self.replica.tier.engine.counters
        out = {name: int(c[key]) for name, key in _COUNTERS.items()}
        out.update({f"load_corrupt_{k}": int(v) for k, v in c.items() if isinstance(k, Corruption)})
        return out

    # -- one request -----------------------------------------------------------------

    def serve(self, request: dict[str, Any]) -> dict[str, Any]:
        replica = self.replica
        keys = self.keys_for(request["tokens"])
        before = self.counters()
        ctx = replica.new_request()

        started = time.perf_counter()
        final, history = replica.find(keys, ctx)
        find_s = time.perf_counter() - started
        # HIT at the first lookup: already in this process's CPU tier. HIT
        # later: found on the volume and promoted (RETRY -> HIT_PENDING -> HIT).
        cpu = {k for k, r in zip(keys, history[0]) if r is self.HIT}
        hits = [k for k in keys if final[k] is self.HIT]
        misses = [k for k in keys if final[k] is not self.HIT]

        mismatched, bad_bytes = self._check_hits(hits, ctx) if hits else ([], 0)
        stored, store_s = 0, 0.0
        if misses:
            stored, store_s = self._store_misses(misses, ctx)
        else:
            replica.finish_request(ctx)
            replica.settle()

        after = self.counters()
        return {
            "id": request["id"],
            "chunks": len(keys),
            "hit_cpu": len(cpu),
            "hit_fs": len(hits) - len(cpu),
            "miss": len(misses),
            "stored": stored,
            "mismatched": mismatched,
            "bad_bytes": bad_bytes,
            "steps": len(history),
            "find_s": find_s,
            "store_s": store_s,
            "delta": {k: after.get(k, 0) - before.get(k, 0) for k in after},
        }

    def _check_hits(self, hits: list[bytes], ctx: Any) -> tuple[list[str], int]:
        """Load the hits from the CPU tier and compare each with its key's
        payload: (hex keys that differ, bytes that differ)."""
        np, replica, manager = self.np, self.replica, self.replica.manager
        mismatched, bad_bytes = [], 0
        with manager.lock:
            spec = manager.prepare_load(hits, ctx)
        for key, chunk in zip(hits, spec.chunk_ids):
            want = np.frombuffer(self.driver.payload_for(key, self.row_bytes), dtype=np.uint8)
            got = replica.rows[chunk].view(np.uint8)
            differ = int(np.count_nonzero(got != want))
            if differ:
                mismatched.append(key.hex())
                bad_bytes += differ
        with manager.lock:
            manager.complete_load(hits, ctx)
        return mismatched, bad_bytes

    def _store_misses(self, misses: list[bytes], ctx: Any) -> tuple[int, float]:
        """ "Compute" the misses, store them, finish the request and wait
        until the tier published them: (chunks stored, seconds)."""
        np, replica, manager = self.np, self.replica, self.replica.manager
        with manager.lock:
            out = manager.prepare_store(misses, ctx)
        if out is None:
            raise RuntimeError("the CPU tier refused the store (raise --cpu-chunks)")
        to_store = list(out.keys_to_store)
        for key, chunk in zip(to_store, out.store_spec.chunk_ids):
            # "Compute" the KV: stand-in for the GPU->CPU copy vLLM's worker does.
            replica.rows[chunk, :] = np.frombuffer(
                self.driver.payload_for(key, self.row_bytes), dtype=np.int8
            )
        started = time.perf_counter()
        if to_store:
            with manager.lock:
                manager.complete_store(to_store, ctx)  # cascades to the tier
        replica.finish_request(ctx)
        replica.settle()
        return len(to_store), time.perf_counter() - started

    def block_paths(self, tokens: list[int]) -> list[str]:
        layout = self.replica.tier.engine.roots[0].layout
        return [layout.block_path(k) for k in self.keys_for(tokens)]

    def close(self) -> None:
        self.replica.close()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llmkv_fs.harness.demo_replica", description=__doc__)
    p.add_argument("--name", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--block-bytes", type=int, required=True)
    p.add_argument("--cpu-chunks", type=int, required=True)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--hash-algo", default="sha256")
    p.add_argument("--accept-trailerless", action="store_true")
    p.add_argument("--seal-key-file", help="seal blocks with the key in this file (key id 1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # Set the protocol channel aside before anything can print to fd 1.
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)

    def reply(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")

    server = None
    try:
        started = time.perf_counter()
        server = ReplicaServer(args)
        reply(
            {
                "event": "ready",
                "pid": os.getpid(),
                "start_s": time.perf_counter() - started,
                "hash_algo": server.hash_algo,
                "fingerprint": server.fingerprint,
                "layout": server.replica.tier.engine.roots[0].layout.rank_dir,
            }
        )
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            if cmd["cmd"] == "serve":
                results = [server.serve(r) for r in cmd["requests"]]
                reply({"event": "served", "results": results, "counters": server.counters()})
            elif cmd["cmd"] == "paths":
                reply({"event": "paths", "paths": server.block_paths(cmd["tokens"])})
            elif cmd["cmd"] == "quit":
                break
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
        counters = server.counters()
        server.close()
        server = None
        reply({"event": "bye", "counters": counters})
        return 0
    except BaseException as exc:
        reply(
            {
                "event": "error",
                "message": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        )
        return 1
    finally:
        if server is not None:
            try:
                server.close()
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
