"""Which root a block lives on when a tier shards over several roots
(``path_sharding: "by_block_hash"``): rendezvous (highest random weight)
hashing of the whole block hash.

Every root gets a score per block, ``xxh3_64(key, seed)`` with the root's
seed ``xxh64(root identity)`` (``rootlist.root_identity``: the spelling of
the path); the block's home is the root with the highest score, its second
choice the next. So the placement depends on the set of roots, never on
their order: reordering the list moves no block, adding an N-th root moves
the 1/N of the blocks whose new home it is (their second choice is then
the root they were written to), removing one moves only its own blocks.

vLLM's open multi-root PR places by the block hash modulo the list's
length instead (reordering or adding a root moves most blocks); a volume
shared with it hits only where the two placements agree (docs/configuration.md).

Immutable: any thread or process may call it.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from llmkv_fs.rootlist import root_identity

__all__ = ["RootPlacement"]

_score = xxhash.xxh3_64_intdigest


class RootPlacement:
    """Rendezvous placement over ``roots`` (see the module doc); indices
    returned are positions in ``roots``."""

    def __init__(self, roots: Sequence[str]):
        self.roots = tuple(roots)
        self._seeds = tuple(
            xxhash.xxh64_intdigest(root_identity(root).encode("utf-8", "surrogateescape"))
            for root in self.roots
        )

    def home(self, key: bytes) -> int:
        """The root a store of ``key`` goes to."""
        if len(self._seeds) == 1:
            return 0
        # A plain loop, not a list of scores and max(): the owner pays this
        # per finished block (docs/benchmarks.md, "Figures behind the code").
        best, best_score = 0, -1
        for index, seed in enumerate(self._seeds):
            score = _score(key, seed)
            if score > best_score:
                best, best_score = index, score
        return best

    def choices(self, key: bytes, depth: int = 2) -> tuple[int, ...]:
        """The ``depth`` best roots for ``key``, best first: where a load
        looks (the second is where the block was written before the root
        that is now its home was added)."""
        if len(self._seeds) == 1:
            return (0,)
        scores = [_score(key, seed) for seed in self._seeds]
        ranked = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
        return tuple(ranked[:depth])
