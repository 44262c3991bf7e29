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

``--shape`` takes a name of ``SHAPES`` or a Hugging Face config (a local
path, or a hub name where the machine may fetch it). ``--device cpu
--shape tiny`` runs everything on the CPU (tests). The exit status is 1 when
any case failed (bytes differ, a load or lookup failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import mmap
import os
import platform
import re
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.layout.paths import CacheLayout, RunIdentity
from llmkv_fs.volume.fsinfo import filesystem_type
from tools.bench.builtin import BuiltinLookups
from tools.bench.support import machine, make_keys
from tools.bench.ttft_plot import case_line, plot, render_tables

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
MiB, GiB = 1 << 20, 1 << 30
PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_job_ids = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the run needs of a model: its attention and MLP sizes."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2  # bf16
    hf_config: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def chunk_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token

    def describe(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.pop("hf_config")
        out["kv_bytes_per_token"] = self.kv_bytes_per_token
        out["config"] = "built-in table" if self.hf_config is None else "Hugging Face config"
        return out


SHAPES = {
    "llama-3.1-8b": Shape("llama-3.1-8b", 32, 8, 128, 4096, 32, 14336, 128256),
    "llama-3.2-1b": Shape("llama-3.2-1b", 16, 8, 64, 2048, 32, 8192, 128256),
    # Tests: 256 bytes of KV per token, so 16 tokens fill one 4 KiB page.
    "tiny": Shape("tiny", 2, 2, 16, 64, 4, 128, 256),
}


def resolve_shape(name: str) -> Shape:
    """A name of SHAPES, else a Hugging Face config (path or hub name)."""
    if name.lower() in SHAPES:
        return SHAPES[name.lower()]
    transformers = importlib.import_module("transformers")
    config = transformers.AutoConfig.from_pretrained(name)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return Shape(
        name=name,
        layers=text.num_hidden_layers,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        hidden=text.hidden_size,
        heads=heads,
        intermediate=text.intermediate_size,
        vocab=text.vocab_size,
        hf_config=config,
    )


class CaseFailed(Exception):
    """A byte differs, a load or a lookup failed: the run reports failure."""


# -- recompute ------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def _synchronizer(torch: Any, device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _is_oom(torch: Any, exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    text = str(exc)
    return isinstance(exc, oom) or "out of memory" in text or "can't allocate" in text


class TorchPrefill:
    """A Llama-like prefill in plain torch, random weights of the shape:
    embedding; per layer RMSNorm, q/k/v projections, rotary embedding, the
    K and V written into a KV cache (as vLLM writes its paged cache),
    causal SDPA with grouped KV heads, output projection, RMSNorm, SwiGLU
    MLP; the final norm and the LM head on the last token only (as vLLM)."""

    def __init__(self, shape: Shape, device: str, torch: Any):
        self.shape, self.torch, self.device = shape, torch, device
        dt = torch.bfloat16

        def weight(*dims: int) -> Any:
            return torch.randn(*dims, device=device, dtype=dt) * 0.02

        s, hd = shape, shape.head_dim
        self.embed = weight(s.vocab, s.hidden)
        self.layers = [
            {
                "q": weight(s.heads * hd, s.hidden),
                "k": weight(s.kv_heads * hd, s.hidden),
                "v": weight(s.kv_heads * hd, s.hidden),
                "o": weight(s.hidden, s.heads * hd),
                "gate": weight(s.intermediate, s.hidden),
                "up": weight(s.intermediate, s.hidden),
                "down": weight(s.hidden, s.intermediate),
                "n1": torch.ones(s.hidden, device=device, dtype=dt),
                "n2": torch.ones(s.hidden, device=device, dtype=dt),
            }
            for _ in range(s.layers)
        ]
        self.norm = torch.ones(s.hidden, device=device, dtype=dt)
        self.lm_head = weight(s.vocab, s.hidden)
        self.inv_freq = 1.0 / (
            500000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
        )

    def _rms(self, x: Any, w: Any) -> Any:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * self.torch.rsqrt(var + 1e-5)).to(x.dtype) * w

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def __call__(self, ids: Any) -> Any:
        torch, s = self.torch, self.shape
        sdpa = torch.nn.functional.scaled_dot_product_attention
        n, hd = ids.shape[0], s.head_dim
        freqs = torch.outer(torch.arange(n, device=self.device, dtype=torch.float32), self.inv_freq)
        cos = freqs.cos().to(torch.bfloat16)[:, None, :]
        sin = freqs.sin().to(torch.bfloat16)[:, None, :]
        kv = torch.empty((s.layers, 2, n, s.kv_heads, hd), device=self.device, dtype=torch.bfloat16)
        x = self.embed[ids]
        with torch.inference_mode():
            for i, w in enumerate(self.layers):
                h = self._rms(x, w["n1"])
                q = self._rope((h @ w["q"].T).view(n, s.heads, hd), cos, sin)
                kv[i, 0] = self._rope((h @ w["k"].T).view(n, s.kv_heads, hd), cos, sin)
                kv[i, 1] = (h @ w["v"].T).view(n, s.kv_heads, hd)
                qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, kv[i, 0], kv[i, 1]))
                if s.kv_heads != s.heads:
                    kt = kt.repeat_interleave(s.heads // s.kv_heads, dim=1)
                    vt = vt.repeat_interleave(s.heads // s.kv_heads, dim=1)
                attn = sdpa(qt, kt, vt, is_causal=True)[0].transpose(0, 1).reshape(n, -1)
                x = x + attn @ w["o"].T
                h = self._rms(x, w["n2"])
                x = x + (torch.nn.functional.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T
            return (self._rms(x[-1:], self.norm) @ self.lm_head.T).argmax(-1)


def _llama_config(transformers: Any, shape: Shape, max_tokens: int) -> Any:
    return transformers.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max(131072, max_tokens),
    )


def transformers_prefill(shape: Shape, device: str, torch: Any, max_tokens: int) -> Any:
    """transformers' causal LM of the shape's config, random weights made on
    the device, bf16, SDPA; one forward with the KV cache on, logits of the
    last token only where the model takes ``logits_to_keep``."""
    transformers = importlib.import_module("transformers")
    config = shape.hf_config or _llama_config(transformers, shape, max_tokens)
    major = int(transformers.__version__.split(".")[0])
    dtype_kw = {"dtype" if major >= 5 else "torch_dtype": torch.bfloat16}
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", **dtype_kw
        )
    model.to(device).eval()
    params = inspect.signature(model.forward).parameters
    keep = next(({k: 1} for k in ("logits_to_keep", "num_logits_to_keep") if k in params), {})

    def forward(ids: Any) -> Any:
        with torch.inference_mode():
            out = model(input_ids=ids[None], use_cache=True, **keep)
        return out.logits[:, -1].argmax(-1)

    return forward


def build_prefill(shape: Shape, args: argparse.Namespace, torch: Any) -> tuple[Any, str]:
    kind = args.recompute
    if kind == "auto":
        kind = "transformers" if importlib.util.find_spec("transformers") else "torch"
    if kind == "transformers":
        transformers = importlib.import_module("transformers")
        forward = transformers_prefill(shape, args.device, torch, max(args.lengths))
        return forward, f"transformers {transformers.__version__} (from_config, bf16, sdpa)"
    return TorchPrefill(shape, args.device, torch), "torch (Llama-like prefill, bf16, SDPA)"


def measure_recompute(shape: Shape, args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    """Per length: every sample's seconds and their median, or "oom"."""
    out: dict[str, Any] = {"impl": None, "lengths": {}}
    if args.recompute == "off":
        out["impl"] = "off"
        return out
    earlier = _earlier_recompute(shape, args)
    if earlier:
        return earlier
    sync = _synchronizer(torch, args.device)
    forward = None
    try:
        forward, out["impl"] = build_prefill(shape, args, torch)
    except Exception as exc:
        if not _is_oom(torch, exc):
            raise
        forward, out["impl"] = None, f"model does not fit: {exc}".splitlines()[0]
    for length in args.lengths:
        out["lengths"][str(length)] = _time_prefill(forward, shape, length, args, torch, sync)
        got = out["lengths"][str(length)]
        print(
            f"# {shape.name} recompute, {length} tokens: "
            + (f"{got['s']:.3f} s" if got["status"] == "ok" else got["status"]),
            flush=True,
        )
    del forward
    _free(torch, args.device)
    return out


def _earlier_recompute(shape: Shape, args: argparse.Namespace) -> dict[str, Any] | None:
    """The shape's recompute from ``--recompute-from`` (an earlier run's
    JSON on this machine) when it has every length, else None."""
    if not args.recompute_from or not os.path.exists(args.recompute_from):
        return None
    with open(args.recompute_from, encoding="utf-8") as f:
        earlier = json.load(f)
    rec = earlier.get("recompute", {}).get(shape.name)
    if not rec or any(str(n) not in rec["lengths"] for n in args.lengths):
        return None
    rec["source"] = f"{args.recompute_from} (GPU {earlier['machine'].get('gpu')})"
    print(f"# {shape.name} recompute from {rec['source']}", flush=True)
    return rec


def _time_prefill(forward, shape, length, args, torch, sync) -> dict[str, Any]:
    """One untimed pass at this length (kernels chosen, the allocator grown
    to its size), then ``--rounds`` timed ones."""
    if forward is None:
        return {"status": "oom", "samples": []}
    samples: list[float] = []
    try:
        for round_no in range(args.rounds + 1):
            ids = torch.randint(0, shape.vocab, (length,), device=args.device)
            sync()
            t = time.perf_counter()
            forward(ids)
            sync()
            if round_no:
                samples.append(time.perf_counter() - t)
    except Exception as exc:
        if not _is_oom(torch, exc):
            raise
    if len(samples) < args.rounds:  # the frames of the failed pass are gone by now
        _free(torch, args.device)
        return {"status": "oom", "samples": samples}
    return {"status": "ok", "samples": samples, "s": statistics.median(samples)}


def _free(torch: Any, device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# -- the CPU primary tier -------------------------------------------------------------


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


# -- the tiers, driven as vLLM's scheduler and tiering manager drive them ------------------


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
        settings = TierSettings.from_mapping({"root_dir": root, "io_workers": args.io_workers})
        self.layout = CacheLayout.for_identity(root, identity)
        self._view = memoryview(region.mm)[: region.nbytes // chunk * chunk]
        self.tier = self.engine = FsEngine(settings, [self.layout], self._view, chunk)
        # Under its store-queue bound (1,024 blocks or 2 GiB, whichever applies).
        self.max_pending_blocks = max(1, min(1024, GiB // chunk))
        self.info = {
            "io_workers": self.engine.io_workers,
            "n_threads": settings.n_read_threads if not self.engine.io_workers else 0,
            "checksum": settings.checksum,
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
    default 16 + 16 threads, its lookups mirrored by BuiltinLookups."""

    name = "builtin"

    def __init__(self, payload: Any, root: str, region: PinnedRegion, chunk: int, threads: int):
        from tools.bench.builtin import BuiltinTier, builtin_batch_lookup

        self.tier = BuiltinTier(payload, root, region.mm, chunk, threads)
        self.max_pending_blocks = 1 << 30
        batch, how = builtin_batch_lookup()
        self.lookups = BuiltinLookups(self.path, batch)
        self.info = {
            "threads": threads,
            "o_direct": self.tier.use_o_direct,
            "lookup": how if how.startswith("fs_io_C") else "os",
        }

    def lookup(self, key: bytes, request: str) -> bool | None:
        return self.lookups.lookup(key)

    def end_step(self) -> None:
        self.lookups.flush()

    def forget(self, request: str) -> None:
        self.lookups.cleanup()

    def path(self, key: bytes) -> str:
        return self.tier._path(key)  # the FileMapper's path, as the tier writes it

    def close(self) -> None:
        self.lookups.close()
        self.tier.shutdown()


def _wait_jobs(side: Side, pending: set[int], poll_s: float, deadline: float, what: str) -> None:
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
            _wait_jobs(side, pending, args.poll_s, deadline, "store")
        job = next(_job_ids)
        chunks = list(range(lo, min(lo + per_job, len(keys))))
        if not side.tier.submit_store(job, keys[lo : lo + per_job], chunks):
            raise CaseFailed(f"{side.name}: store job refused")
        pending.add(job)
    while pending:
        _wait_jobs(side, pending, args.poll_s, deadline, "store")
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
    request, job = f"ttft-{next(_job_ids)}", next(_job_ids)
    clock = time.perf_counter
    t0 = clock()
    steps = lookup_until_known(side, keys, request, args)
    t1 = clock()
    if not side.tier.submit_load(job, keys, list(range(len(keys)))):
        raise CaseFailed(f"{side.name}: load job refused")
    _wait_jobs(side, {job}, args.poll_s, time.monotonic() + args.job_deadline_s, "load")
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


# -- one case: a shape, a chunk size, a medium, a length -------------------------------------


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
        if not _is_oom(torch, exc):
            raise
        case[side.name] = {"status": "oom", "reason": str(exc).splitlines()[0]}
    finally:
        env.pop("want", None)
        _free(torch, args.device)
        _remove_files(side, keys)
        case["load_average"] = os.getloadavg()
    print("# " + case_line(case, side.name), flush=True)


def _remove_files(side: Side, keys: list[bytes]) -> None:
    for key in keys:
        try:
            os.unlink(side.path(key))
        except OSError:
            pass


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
    env["sync"] = _synchronizer(torch, args.device)
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
    info = machine(args.dirs)
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


# -- command line --------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--shape",
        "--model",
        dest="shapes",
        action="append",
        metavar="NAME_OR_PATH",
        help=f"model shape: {', '.join(SHAPES)} or a Hugging Face config (repeatable; "
        "default llama-3.1-8b)",
    )
    p.add_argument(
        "--lengths",
        type=_ints,
        default=_ints("4096,16384,32768,65536,131072"),
        help="prompt lengths in tokens (default 4096,16384,32768,65536,131072)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=_ints,
        default=[16, 256],
        help="tokens per chunk (one file; default 16,256)",
    )
    p.add_argument(
        "--dir",
        dest="dirs",
        action="append",
        help="a directory on a medium to test (repeatable: tmpfs, the disk...)",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed samples per case (median)")
    p.add_argument(
        "--builtin",
        metavar="PAYLOAD_DIR",
        help="vLLM's built-in fs tier payload (tools/bench/builtin_payload.py)",
    )
    p.add_argument(
        "--builtin-threads",
        type=int,
        default=16,
        help="its read and write threads each (vLLM's default 16)",
    )
    p.add_argument(
        "--io-workers",
        default="auto",
        help="ours: io_workers (default auto, what an operator gets)",
    )
    p.add_argument(
        "--recompute",
        choices=("auto", "transformers", "torch", "off"),
        default="auto",
        help="the prefill: transformers' model, the plain-torch one, or none; auto: "
        "transformers where installed",
    )
    p.add_argument(
        "--recompute-from",
        metavar="JSON",
        help="take recompute from an earlier run's JSON on this machine where it has every "
        "length (e.g. a second call for the disk); measured otherwise",
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (tests)")
    p.add_argument("--max-gib", type=float, default=24.0, help="skip cases with more KV")
    p.add_argument(
        "--read-threads",
        type=_ints,
        default=[16, 32],
        help="plain-read reference thread counts (best counts; default 16,32)",
    )
    p.add_argument(
        "--store-job-tokens",
        type=int,
        default=2048,
        help="tokens per store job (one prefill step's worth)",
    )
    p.add_argument("--poll-ms", type=float, default=1.0, help="scheduler step / poll interval")
    p.add_argument("--settle-s", type=float, default=2.0, help="idle time of a new tier instance")
    p.add_argument("--job-deadline-s", type=float, default=300.0)
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no case after this many seconds (the JSON keeps what ran)",
    )
    p.add_argument("--shm", action="store_true", help="CPU tier in a /dev/shm file, not a memfd")
    p.add_argument("--json", default="ttft.json", help="every sample (default %(default)s)")
    p.add_argument("--plot", default=None, help="PNG of seconds against length (matplotlib)")
    p.add_argument(
        "--tamper",
        action="store_true",
        help="self-check: flip one byte of one stored file before loading; every "
        "case must then fail",
    )
    args = p.parse_args(argv)
    args.shapes = args.shapes or ["llama-3.1-8b"]
    args.dirs = args.dirs or ["/dev/shm/llmkv-ttft"]
    args.io_workers = args.io_workers if args.io_workers == "auto" else int(args.io_workers)
    args.poll_s = args.poll_ms / 1000
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.started = time.monotonic()
    torch = _torch()
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
