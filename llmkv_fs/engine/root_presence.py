"""Whether a key's block is on the engine's roots, for the lookups
(engine/lookup.py): on its home root, else -- with several roots -- on its
second choice, where it was written before its home was added
(layout/placement.py). A lost root is not touched; one found gone
meanwhile (RootGone: lost since its housekeeping last looked) is as if
lost. A key not found on its other roots then answers None, not False:
nobody looked where its file may be (engine/lookup_checks.py, ``Found``).

``on_their_roots`` is the one answer, for one key or a batch: each root is
asked once for all the keys it is first asked about (``BlockIO.exists_many``:
the compiled check where it runs), the second choices only for the keys
their home did not have.

Threading: lookup threads; reads each root's ``lost`` flag (set by its
housekeeping) and calls its BlockIO, whose descriptors are per thread.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.engine.lookup_checks import Found
from llmkv_fs.engine.roots import EngineRoot
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.volume.pinned_root import RootGone

__all__ = ["at_once", "each_key", "on_their_roots"]


def each_key(blockio: BlockIO, keys: list[bytes]) -> list[bool]:
    """A root's check of ``keys`` one ``exists`` at a time."""
    return [blockio.exists(key) for key in keys]


def at_once(blockio: BlockIO, keys: list[bytes], budget_s: float = 0.0) -> list[bool]:
    """A root's check of ``keys`` in one call (compiled where it runs);
    with ``budget_s``, possibly of the first keys only."""
    return blockio.exists_many(keys, budget_s)


def on_their_roots(
    roots: Sequence[EngineRoot],
    placement: RootPlacement,
    keys: list[bytes],
    check: Callable[[BlockIO, list[bytes]], list[bool]] = at_once,
) -> list[Found]:
    """Whether each key's block is on its roots (the module doc), in order,
    each root asked through ``check``; raises what a root's check raises
    other than RootGone. A check that answers fewer keys than asked (its
    time budget spent) makes this answer the keys before the first one it
    left, one at least."""
    if len(roots) == 1:  # every key's only choice: no per-key placement (8,192-key prompts)
        answers = _asked(roots[0], keys, check)
        return [None] * len(keys) if answers is None else list(answers)
    found: list[Found] = [False] * len(keys)
    unasked: set[int] = set()  # keys one of whose roots was lost
    answered = len(keys)
    choices = [placement.choices(key) for key in keys]
    for rank in range(max(map(len, choices), default=0)):
        asked: dict[int, list[int]] = collections.defaultdict(list)
        for at, chosen in enumerate(choices[:answered]):
            if rank < len(chosen) and not found[at]:
                asked[chosen[rank]].append(at)
        for index, members in asked.items():
            answers = _asked(roots[index], [keys[at] for at in members], check)
            if answers is None:
                unasked.update(members)
                continue
            for at, hit in zip(members, answers):
                found[at] = hit
            if len(answers) < len(members):
                answered = min(answered, members[len(answers)])
    for at in unasked:
        if not found[at]:
            found[at] = None
    return found[:answered]


def _asked(
    root: EngineRoot, keys: list[bytes], check: Callable[[BlockIO, list[bytes]], list[bool]]
) -> list[bool] | None:
    """``root``'s answers for ``keys``; None where it is lost, or found gone."""
    if root.lost:
        return None
    try:
        return check(root.blockio, keys)
    except RootGone:
        return None
