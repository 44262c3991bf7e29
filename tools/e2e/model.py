"""Build a small Llama model with random weights and a locally trained
tokenizer, for a real ``vllm serve`` without hub access.

Run with the e2e venv's Python (it needs transformers and tokenizers, which
vLLM installs): ``python model.py OUT_DIR [--layers N --hidden H]``.
The weights are seeded, so two builds of one shape are identical; greedy
output is gibberish, but deterministic, which is all the tests compare.

Imports nothing of llmkv_fs: it runs as a script in a venv that may not hold
this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import random

VOCAB_SIZE = 4096
# Shapes by name. "bench": 12 KB of KV per token (bf16), recompute of 4000
# tokens ~2 s on 2 cores; "test": small enough that a restart dominates.
SHAPES = {
    "test": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512},
    "bench": {"layers": 12, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2816},
}


def _corpus(lines: int = 4000, seed: int = 0):
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ra", "to", "vi", "de", "po", "an", "el", "or", "ix"]
    for _ in range(lines):
        words = ("".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(12))
        yield " ".join(words) + ".\n"


def build_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out_dir)


def build_model(out_dir: str, shape: dict[str, int]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        # 10x the default: with 0.02 the greedy output barely depends on the
        # prompt (one token repeated), so wrong KV would go unnoticed; with 0.1
        # eight greedy tokens differ from prompt to prompt (measured).
        initializer_range=0.1,
        torch_dtype="bfloat16",  # type: ignore[call-arg,unused-ignore]
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="test")
    args = parser.parse_args()
    tmp = args.out_dir + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    build_tokenizer(tmp)
    build_model(tmp, SHAPES[args.shape])
    with open(os.path.join(tmp, "llmkv_fs_shape.json"), "w") as f:
        json.dump({"shape": args.shape, **SHAPES[args.shape]}, f)
    os.replace(tmp, args.out_dir)


if __name__ == "__main__":
    main()
