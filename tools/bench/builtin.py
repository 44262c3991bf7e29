"""vLLM 0.33's built-in fs tier byte path as a configuration of
tools/bench/engine.py (``--builtin PAYLOAD_DIR``): its unmodified
``tiering/fs/io.py`` and ``thread_pool.py`` and its C extension
``fs_io_C``, from a payload made by tools/bench/builtin_payload.py, so it
runs where vLLM is not installed.

``BuiltinTier`` submits exactly as vLLM's ``FileSystemTierManager``
(``tiering/fs/manager.py``) does: a ``DualQueueThreadPool`` of n read + n
write threads; per store job one pool task, a ``functools.partial`` of
``io.batch_store_block`` over the job's paths and offsets, through
``enqueue_store(job_id, 1, [task])``; per load job one closure calling
``io.batch_load_block`` (recording ``num_succeeded`` on an OSError), through
``enqueue_load``; O_DIRECT as probed by ``io.probe_o_direct`` in the tier's
folder; finished jobs from ``get_finished()``. Paths are the FileMapper's
shape: ``<base>_r0/<hhh>/<hh>_g<group>/<hash hex>.bin`` (``builtin_path``).
What it leaves out of the manager is bookkeeping that moves no bytes (KV
events); its lookups are ``BuiltinLookups`` (used by tools/bench/ttft_sides.py and
tools/bench/lookup.py): the payload's unmodified ``AsyncLookupManager`` over
``builtin_batch_lookup``.

Python < 3.12: ``fs_io_C`` returns None without a new reference, so every
call lowers None's reference count by one and the process aborts
(``none_dealloc``) at zero. Each submitted job adds one reference to a
ballast list first, so the count never falls, and the list is never freed
(not even at exit); from 3.12 None is immortal and nothing is kept.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from llmkv_fs.layout.names import block_rel_path

# One reference to None per fs_io_C call made (Python < 3.12 only). The list
# itself is never freed (one reference more than anyone drops): freeing it at
# exit would drop those references while the calls' decrements stand.
_NONE_BALLAST: list[None] = []
_KEEP_NONE = sys.version_info < (3, 12)
if _KEEP_NONE:
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_NONE_BALLAST))


@dataclasses.dataclass(frozen=True)
class Payload:
    io: ModuleType
    thread_pool: ModuleType
    async_lookup: ModuleType
    base: ModuleType  # the stand-in of vllm.v1.kv_offload.base: ReqContext
    manifest: dict


def load_payload(path: str) -> Payload:
    """Import the payload's io.py, thread_pool.py and async_lookup.py (ahead
    of any vLLM installed here) and check that io.py runs its C path."""
    path = os.path.abspath(path)
    if not os.path.exists(os.path.join(path, "vllm/v1/kv_offload/tiering/async_lookup.py")):
        raise RuntimeError(
            f"{path} has no async_lookup.py (an older payload): make it again with "
            "python -m tools.bench.builtin_payload"
        )
    sys.path.insert(0, path)
    io = importlib.import_module("vllm.v1.kv_offload.tiering.fs.io")
    pool = importlib.import_module("vllm.v1.kv_offload.tiering.fs.thread_pool")
    lookups = importlib.import_module("vllm.v1.kv_offload.tiering.async_lookup")
    base = importlib.import_module("vllm.v1.kv_offload.base")
    for module in (io, pool, lookups, base, sys.modules["vllm"]):
        if not os.path.abspath(module.__file__ or "").startswith(path + os.sep):
            raise RuntimeError(f"{module.__name__} came from {module.__file__}, not {path}")
    if not io._HAS_FSIO_C:
        raise RuntimeError("the payload's io.py did not load vllm.fs_io_C")
    with open(os.path.join(path, "MANIFEST.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    return Payload(io, pool, lookups, base, manifest)


def builtin_path(base: str, key: bytes) -> str:
    """The FileMapper's path of ``key`` (an OffloadKey) under the tier's
    ``base`` (``<root>/vllm_builtin``): rank 0's directory, then the same
    fan-out as ours (``block_rel_path``, byte for byte)."""
    return f"{base}_r0/{block_rel_path(key)}"


def builtin_batch_lookup() -> tuple[Callable[[list[str]], Any], str]:
    """What vLLM's ``FsAsyncLookupManager.batch_lookup`` calls, and its name:
    ``fs_io_C.batch_lookup`` (faccessat per path, GIL released for the whole
    batch) where the loaded extension has it, else ``os.path.exists`` per
    path, as there. Load a payload first (``load_payload``)."""
    c_ext = sys.modules.get("vllm.fs_io_C")
    batch = getattr(c_ext, "batch_lookup", None)
    if batch is not None:
        return batch, "fs_io_C.batch_lookup"

    def exists_each(paths: list[str]) -> list[bool]:
        return [os.path.exists(p) for p in paths]

    return exists_each, "os.path.exists"


@dataclasses.dataclass(frozen=True)
class Finished:
    job_id: int
    failed: tuple[int, ...]  # drive() only asks whether it is empty


class BuiltinTier:
    """The built-in tier's byte path, driven like FsEngine (see the module
    doc for what it does as vLLM's manager does)."""

    def __init__(self, payload: Payload, root: str, primary: Any, block: int, per_side: int):
        t = time.perf_counter()
        self._io = payload.io
        self._base = os.path.join(root, "vllm_builtin")
        os.makedirs(self._base, exist_ok=True)
        self.use_o_direct = bool(payload.io.probe_o_direct(self._base))
        self._view = memoryview(primary)
        self._block = block
        self._pool = payload.thread_pool.DualQueueThreadPool(
            per_side, per_side, thread_name_prefix="vllm_kv_py_fs"
        )
        self._job_block_counts: dict[int, int] = {}
        self._load_progress: dict[int, int] = {}
        self.startup_s = time.perf_counter() - t

    def _path(self, key: bytes) -> str:
        return builtin_path(self._base, key)

    def submit_store(self, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> bool:
        task = functools.partial(
            self._io.batch_store_block,
            [self._path(key) for key in keys],
            self._view,
            [int(cid) * self._block for cid in chunk_ids],
            self._block,
            self.use_o_direct,
        )
        self._job_block_counts[job_id] = len(keys)
        if _KEEP_NONE:
            _NONE_BALLAST.append(None)
        self._pool.enqueue_store(job_id, 1, [task])
        return True

    def submit_load(self, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> bool:
        self._job_block_counts[job_id] = len(keys)
        paths = [self._path(key) for key in keys]
        offsets = [int(cid) * self._block for cid in chunk_ids]

        def load_task() -> None:
            try:
                self._io.batch_load_block(
                    paths, self._view, offsets, self._block, self.use_o_direct
                )
            except OSError as exc:
                self._load_progress[job_id] = getattr(exc, "num_succeeded", 0)
                raise

        if _KEEP_NONE:
            _NONE_BALLAST.append(None)
        self._pool.enqueue_load(job_id, 1, [load_task])
        return True

    def take_finished(self) -> list[Finished]:
        done = []
        for job_id, success, _transfer_time in self._pool.get_finished():
            count = self._job_block_counts.pop(job_id, 0)
            kept = self._load_progress.pop(job_id, 0)
            failed = () if success else (tuple(range(kept, count)) or (kept,))
            done.append(Finished(job_id, failed))
        return done

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._view.release()


class BuiltinLookups:
    """vLLM 0.33's lookups of its fs tier, unmodified: the payload's
    ``AsyncLookupManager`` (tiering/async_lookup.py, byte for byte: a
    ``LookupState`` per key with its requests, the reverse index of each
    request's keys, generations, one batch a step to one background
    thread), its ``batch_lookup`` as ``FsAsyncLookupManager``
    (tiering/fs/manager.py) implements it: the FileMapper paths checked by
    ``fs_io_C.batch_lookup`` (faccessat, GIL released; ``os.path.exists``
    where the extension lacks it, as there).

    ``manager.lookup(key, context)`` is what ``FileSystemTierManager.lookup``
    calls (the caller stands for that frame, as for ours), with the
    request's ``context`` (``context(request_id)``: vLLM passes a request's
    one ReqContext every time); ``flush`` is the tier's on_schedule_end,
    ``cleanup`` its on_request_finished."""

    def __init__(
        self, payload: Payload, path_of: Callable[[bytes], str], batch: Callable[..., Any]
    ):
        def batch_lookup(keys: list[bytes], req_context: Any) -> Any:
            return batch([path_of(k) for k in keys])

        manager_class = type(
            "FsAsyncLookupManager",
            (payload.async_lookup.AsyncLookupManager,),
            {"batch_lookup": staticmethod(batch_lookup)},
        )
        self.manager = manager_class("fs")
        self._req_context = payload.base.ReqContext

    def context(self, request_id: str) -> Any:
        return self._req_context(request_id)

    def flush(self) -> None:
        self.manager.flush()

    def cleanup(self, request_id: str) -> None:
        self.manager.cleanup(request_id)

    def close(self) -> None:
        self.manager.shutdown()
