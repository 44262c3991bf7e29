"""The model shapes tools/bench/ttft.py runs: what a run needs of a model
(its attention and MLP sizes, the KV bytes a token takes), a table of known
ones, and the shape of any Hugging Face config (``resolve_shape``)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any


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
