"""The two tiers of tools/bench/ttft.py as vLLM drives them ("sides"):
``OursSide`` (our FsEngine, the settings an operator gets) and
``BuiltinSide`` (vLLM 0.33's own fs tier byte path from a payload,
tools/bench/builtin.py), both over ``PinnedRegion``, the stand-in of vLLM's
CPU primary tier; and the driving: stores in jobs under the tier's pending
bound (``store_all``), lookups polled step by step as vLLM's scheduler polls
(``lookup_until_known``), finished jobs taken (``wait_jobs``).

Threads: one thread (the run's) drives a side; the tiers' own workers
(threads or processes) map the region, so it is shared memory (a memfd or a
/dev/shm file), never plain anonymous memory."""

from __future__ import annotations

import gc
import itertools
import mmap
import os
import time
from typing import Any

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.layout.paths import CacheLayout, RunIdentity
from tools.bench.builtin import BuiltinLookups

GiB = 1 << 30
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_job_ids = itertools.count(1)


class CaseFailed(Exception):
    """A byte differs, a load or a lookup failed: the run reports failure."""


def next_job_id() -> int:
    """A job id (or request number) no other job of this process has."""
    return next(_job_ids)


class PinnedRegion:
    """The CPU tier stand-in: shared memory worker processes can map (a
    memfd, or a /dev/shm file like vLLM's SharedOffloadRegion), populated,
    and on CUDA registered as pinned memory (cudaHostRegister, as vLLM pins
    its region), seen by torch as one uint8 tensor."""

    def __init__(self, nbytes: int, torch: Any, pin: bool, shm: bool):
        self.nbytes, self.torch, self.pinned = nbytes, torch, False
        if shm:
            path = f"/dev/shm/llmkv_bench_ttft_{os.getpid()}.mmap"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(path)  # mapped and handed over by fd; nothing left behind
        else:
            fd = os.memfd_create("llmkv_bench_ttft", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            pass  # older kernel: pages fault in on first touch
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(getattr(err, "value", err)) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
            self.pinned = True

    def rows(self, n: int, row_bytes: int) -> Any:
        return self.tensor[: n * row_bytes].view(n, row_bytes)

    def close(self) -> None:
        if self.pinned:
            self.torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        gc.collect()
        try:
            self.mm.close()
        except BufferError:
            pass  # a view still exported: the process's exit frees it


class Side:
    """One tier as the run drives it: ``tier`` (submit_*, take_finished),
    lookups, the path of a key's file, and what it runs with."""

    name = ""
    tier: Any
    info: dict[str, Any]
    max_pending_blocks: int  # store blocks the run keeps in flight

    def lookup(self, key: bytes, request: str) -> bool | None:
        raise NotImplementedError

    def end_step(self) -> None:
        raise NotImplementedError

    def forget(self, request: str) -> None:
        raise NotImplementedError

    def path(self, key: bytes) -> str:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class OursSide(Side):
    """Our FsEngine with the settings an operator gets (the defaults:
    io_workers auto, checksum on, O_DIRECT where the volume takes it)."""

    name = "ours"

    def __init__(self, root: str, identity: RunIdentity, region: PinnedRegion, chunk: int, args):
        key = getattr(args, "seal_key_file", None)
        sealing = {"seal_key_files": {"1": key}} if key else {}
        settings = TierSettings.from_mapping(
            {"root_dir": root, "io_workers": args.io_workers, **sealing}
        )
        layout = CacheLayout.for_identity(root, identity)
        self._view = memoryview(region.mm)[: region.nbytes // chunk * chunk]
        self.tier = self.engine = FsEngine(settings, [layout], self._view, chunk)
        self.layout = self.engine.roots[0].layout  # sealed blocks have their own namespace
        # Under its store-queue bound (1,024 blocks or 2 GiB, whichever applies).
        self.max_pending_blocks = max(1, min(1024, GiB // chunk))
        self.info = {
            "io_workers": self.engine.io_workers,
            "n_threads": settings.n_read_threads if not self.engine.io_workers else 0,
            "checksum": settings.checksum,
            "sealed": bool(settings.seal_key_files),
            "o_direct": self.engine.roots[0].use_o_direct,
        }

    def lookup(self, key: bytes, request: str) -> bool | None:
        return self.engine.lookup(key, request)

    def end_step(self) -> None:
        self.engine.end_step()

    def forget(self, request: str) -> None:
        self.engine.forget_request(request)

    def path(self, key: bytes) -> str:
        return self.layout.block_path(key)

    def close(self) -> None:
        self.engine.shutdown()
        self._view.release()


class BuiltinSide(Side):
    """vLLM's built-in fs tier byte path (tools/bench/builtin.py) with its
    default 16 + 16 threads, its lookups vLLM's own (BuiltinLookups)."""

    name = "builtin"

    def __init__(self, payload: Any, root: str, region: PinnedRegion, chunk: int, threads: int):
        from tools.bench.builtin import BuiltinTier, builtin_batch_lookup

        self.tier = BuiltinTier(payload, root, region.mm, chunk, threads)
        self.max_pending_blocks = 1 << 30
        batch, how = builtin_batch_lookup()
        self.lookups = BuiltinLookups(payload, self.path, batch)
        self._contexts: dict[str, Any] = {}  # a request's one ReqContext, as vLLM keeps it
        self.info = {
            "threads": threads,
            "o_direct": self.tier.use_o_direct,
            "lookup": how if how.startswith("fs_io_C") else "os",
        }

    def lookup(self, key: bytes, request: str) -> bool | None:
        context = self._contexts.get(request)
        if context is None:
            context = self._contexts[request] = self.lookups.context(request)
        return self.lookups.manager.lookup(key, context)

    def end_step(self) -> None:
        self.lookups.flush()

    def forget(self, request: str) -> None:
        self._contexts.pop(request, None)
        self.lookups.cleanup(request)

    def path(self, key: bytes) -> str:
        return self.tier._path(key)  # the FileMapper's path, as the tier writes it

    def close(self) -> None:
        self.lookups.close()
        self.tier.shutdown()


def wait_jobs(side: Side, pending: set[int], poll_s: float, deadline: float, what: str) -> None:
    """Poll take_finished until some job of ``pending`` finished (it leaves
    the set); CaseFailed on a failed one."""
    before = len(pending)
    while True:
        for job in side.tier.take_finished():
            if job.failed:
                raise CaseFailed(
                    f"{side.name} {what} job: {len(job.failed)} blocks failed"
                    + _failures(getattr(side.tier, "counters", {}))
                )
            pending.discard(job.job_id)
        if len(pending) < before:
            return
        if time.monotonic() > deadline:
            raise CaseFailed(f"{side.name} {what}: no answer within the deadline")
        time.sleep(poll_s)


def _failures(counters: Any) -> str:
    """Our engine's failure counters, short: " (load/corrupt 1, bad-checksum 1)"."""
    named = [
        "/".join(str(getattr(p, "value", p)) for p in key) + f" {value}"
        if isinstance(key, tuple)
        else f"{key} {value}"
        for key, value in counters.items()
        if isinstance(key, (tuple, str))
    ]
    return f" ({', '.join(named)})" if named else ""


def store_all(side: Side, keys: list[bytes], per_job: int, args) -> float:
    """Store every chunk in jobs of ``per_job``, as many in flight as the
    tier's pending bound lets (vLLM stores as the prefill computes)."""
    t = time.perf_counter()
    deadline = time.monotonic() + args.job_deadline_s
    limit = max(1, side.max_pending_blocks // per_job)
    pending: set[int] = set()
    for lo in range(0, len(keys), per_job):
        while len(pending) >= limit:
            wait_jobs(side, pending, args.poll_s, deadline, "store")
        job = next_job_id()
        chunks = list(range(lo, min(lo + per_job, len(keys))))
        if not side.tier.submit_store(job, keys[lo : lo + per_job], chunks):
            raise CaseFailed(f"{side.name}: store job refused")
        pending.add(job)
    while pending:
        wait_jobs(side, pending, args.poll_s, deadline, "store")
    return time.perf_counter() - t


def lookup_until_known(side: Side, keys: list[bytes], request: str, args) -> int:
    """Steps of vLLM's prefix lookup (``_maximal_prefix_lookup``: every key
    asked, a RETRY does not stop the scan, a miss does) until every key
    hits; the tier's end of step between them. Returns the steps taken."""
    deadline = time.monotonic() + args.job_deadline_s
    for step in itertools.count(1):
        known = True
        for i, key in enumerate(keys):
            found = side.lookup(key, request)
            if found is False:
                raise CaseFailed(f"{side.name}: lookup of chunk {i} answered miss")
            known = known and found is True
        if known:
            return step
        side.end_step()
        if time.monotonic() > deadline:
            raise CaseFailed(f"{side.name}: lookups unanswered after {step} steps")
        time.sleep(args.poll_s)
    raise AssertionError("unreachable")
