"""Why two run configs do not share blocks: the fields of two ``config.json``
objects (``paths.RunIdentity.run_config``) that differ, each named as an
operator sets it in vLLM (``block_size``, ``dtype``, ``tensor_parallel_size``,
...) and said in plain words with its fix. ``llmkv-fs doctor`` and the
tier's start-up line speak through this one table.

Pure: no I/O. The objects are untrusted (another deployment's config.json):
any JSON value is accepted, and a field of an unexpected shape is reported
as differing, never raised on. Values are quoted shortened (``_show``), so a
hostile file cannot flood a log line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Difference", "differences"]

_SHOWN_CHARS = 40  # of one value, in a message


@dataclasses.dataclass(frozen=True)
class Difference:
    """One reason two run configs have other digests. ``field``: vLLM's
    name for the setting; ``ours``/``theirs``: the values as shown."""

    field: str
    ours: str
    theirs: str
    meaning: str
    fix: str

    def sentence(self) -> str:
        return f"{self.field} {self.ours} vs {self.theirs}: {self.meaning} ({self.fix})"

    def as_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


# run-config key -> (vLLM's name, what the difference means, the fix)
_PLAIN: dict[str, tuple[str, str, str]] = {
    "model_name": (
        "model",
        "another model; blocks are never shared between models",
        "serve the same --model (and revision) everywhere",
    ),
    "dtype": (
        "dtype",
        "the KV cache holds other bytes per token, nothing can be shared",
        "start every replica with the same --dtype / --kv-cache-dtype",
    ),
    "tp_size": (
        "tensor_parallel_size",
        "each rank holds another slice of the KV heads, nothing can be shared",
        "use the same --tensor-parallel-size, or a parallel-agnostic KV layout",
    ),
    "pp_size": (
        "pipeline_parallel_size",
        "each rank holds other layers, nothing can be shared",
        "use the same --pipeline-parallel-size",
    ),
    "pcp_size": (
        "prefill_context_parallel_size",
        "each rank holds another part of the context, nothing can be shared",
        "use the same --prefill-context-parallel-size",
    ),
    "dcp_size": (
        "decode_context_parallel_size",
        "each rank holds another part of the context, nothing can be shared",
        "use the same --decode-context-parallel-size",
    ),
    "tokens_per_hash": (
        "hash_block_size",
        "block hashes cover another number of tokens, no name matches",
        "use the same --block-size (and hash block size) everywhere",
    ),
    "blocks_per_file": (
        "offloading_block_size",
        "a file holds another number of blocks, no name matches",
        "use the same kv_connector_extra_config block_size everywhere",
    ),
    "parallel_agnostic": (
        "parallel_agnostic",
        "one stores per rank, the other one layout for all ranks",
        "use the same KV layout (a parallel-agnostic attention backend or not) everywhere",
    ),
    "replicated_layout": (
        "kv_layout",
        "one stores a replicated KV layout, the other per rank",
        "use the same KV layout everywhere",
    ),
    "canonical_format": (
        "kv_layout",
        "the blocks are in another canonical KV layout",
        "use the same attention backend / KV layout everywhere",
    ),
    "llmkv_fs_sealing": (
        "sealing",
        "sealed blocks live apart from plain ones; a plain replica never reads them",
        "set seal_key_files on every replica or on none",
    ),
    "inference_engine": (
        "inference_engine",
        "written by another inference engine",
        "serve with the same engine",
    ),
}
# vLLM writes these flags only when they differ from their usual value
# (so older deployments keep their digests): absent means this.
_ABSENT_MEANS: dict[str, Any] = {"parallel_agnostic": True, "replicated_layout": False}
_BLOCK_SIZE = (
    "block_size",
    "a prompt is cut into other blocks, nothing can be shared",
    "start every replica with the same --block-size",
)
_LAYERS = (
    "kv_layout",
    "the KV cache groups hold other layers (another model revision or architecture, "
    "or another attention layout), nothing can be shared",
    "serve the same model revision with the same attention settings everywhere",
)


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("ascii", "backslashreplace").decode()
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _groups(config: dict[str, Any]) -> list[tuple[Any, Any]] | None:
    """(tokens_per_block, layer_names) per KV cache group; None when the
    field is not a list of objects."""
    groups = config.get("kv_cache_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return None
    return [(g.get("tokens_per_block"), g.get("layer_names")) for g in groups]


def _group_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[Difference]:
    mine, other = _groups(ours), _groups(theirs)
    if mine == other:
        return []
    if mine is None or other is None or len(mine) != len(other):
        count = [len(g) if g is not None else "unreadable" for g in (mine, other)]
        return [Difference(_LAYERS[0], f"{count[0]} groups", f"{count[1]} groups", *_LAYERS[1:])]
    found = []
    sizes = [(a[0], b[0]) for a, b in zip(mine, other) if a[0] != b[0]]
    if sizes:
        found.append(
            Difference(_BLOCK_SIZE[0], _show(sizes[0][0]), _show(sizes[0][1]), *_BLOCK_SIZE[1:])
        )
    if any(a[1] != b[1] for a, b in zip(mine, other)):
        layers = [len(g[1]) if isinstance(g[1], list) else "?" for g in (mine[0], other[0])]
        found.append(
            Difference(_LAYERS[0], f"{layers[0]} layers", f"{layers[1]} layers", *_LAYERS[1:])
            if layers[0] != layers[1]
            else Difference(_LAYERS[0], "these layers", "other layer names", *_LAYERS[1:])
        )
    return found


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[Difference]:
    """Every field of two run configs that differs, in vLLM's words, one
    entry per setting (two keys naming one setting, e.g. replicated_layout
    and canonical_format, give one entry each). [] when they are equal."""
    found: list[Difference] = []
    for key in sorted(set(ours) | set(theirs)):
        if key == "kv_cache_groups":
            found.extend(_group_differences(ours, theirs))
            continue
        default = _ABSENT_MEANS.get(key)
        a, b = ours.get(key, default), theirs.get(key, default)
        if a == b:
            continue
        name, meaning, fix = _PLAIN.get(
            key, (key, "another run-config field, nothing can be shared", "configure it alike")
        )
        found.append(Difference(name, _show(a), _show(b), meaning, fix))
    return found
