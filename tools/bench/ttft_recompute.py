"""Recompute for tools/bench/ttft.py: the GPU prefill of a prompt, timed
(random weights of the shape; transformers' causal LM with SDPA when
transformers is there, else a Llama-like prefill in plain torch), one
request at a time, median of ``--rounds``; or taken from an earlier run's
JSON (``--recompute-from``). Also the torch helpers the run shares: the
import, a device synchronizer, OOM detection, freeing memory.

torch is imported lazily (``import_torch``) so the module loads without it;
everything here runs on the caller's thread."""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import inspect
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from tools.bench.ttft_shapes import Shape


def import_torch() -> Any:
    import torch

    return torch


def synchronizer(torch: Any, device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def is_oom(torch: Any, exc: BaseException) -> bool:
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
    sync = synchronizer(torch, args.device)
    forward = None
    try:
        forward, out["impl"] = build_prefill(shape, args, torch)
    except Exception as exc:
        if not is_oom(torch, exc):
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
    free_memory(torch, args.device)
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
        if not is_oom(torch, exc):
            raise
    if len(samples) < args.rounds:  # the frames of the failed pass are gone by now
        free_memory(torch, args.device)
        return {"status": "oom", "samples": samples}
    return {"status": "ok", "samples": samples, "s": statistics.median(samples)}


def free_memory(torch: Any, device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
