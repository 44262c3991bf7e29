"""A key's block on the engine's roots (engine/roots.py): a batch
answers exactly what each key answers alone -- home root first, the second
choice only for keys their home did not have, a lost root never touched, a
root found gone (RootLost) as if lost -- over three roots placed by the real
RootPlacement. The roots' checks are stand-ins that record what they were
asked; tests/engine/test_lookup.py runs the same through real files."""

from __future__ import annotations

import errno
import functools
from types import SimpleNamespace

import pytest

from llmkv_fs.engine.roots import at_once, on_their_roots
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.volume.pinned_root import RootLost
from tests.kits.engine_kit import make_key


class Checks:
    """One root's block checks: ``present`` keys answer yes; ``gone``: every
    check raises RootLost; records every key asked."""

    def __init__(self, present: set[bytes], gone: bool = False, budget_keys: int = 0):
        self.present = present
        self.gone = gone
        self.budget_keys = budget_keys  # > 0: a budgeted call answers this many keys at most
        self.asked: list[bytes] = []

    def exists(self, key: bytes) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: list[bytes], budget_s: float = 0.0) -> list[bool]:
        if budget_s and self.budget_keys:
            keys = keys[: self.budget_keys]
        self.asked.extend(keys)
        if self.gone:
            raise RootLost(errno.ENOENT, "gone", "/root")
        return [key in self.present for key in keys]


KEYS = [make_key(i) for i in range(300)]


def roots_where(placement: RootPlacement, lost: int | None, gone: int | None):
    """Three roots; a key is on its home (i % 3 == 0), on its second choice
    (i % 3 == 1) or nowhere."""
    present: list[set[bytes]] = [set(), set(), set()]
    for i, key in enumerate(KEYS):
        home, second = placement.choices(key)
        if i % 3 == 0:
            present[home].add(key)
        elif i % 3 == 1:
            present[second].add(key)
    return [
        SimpleNamespace(lost=index == lost, blockio=Checks(present[index], gone=index == gone))
        for index in range(3)
    ]


@pytest.mark.parametrize(("lost", "gone"), [(None, None), (1, None), (None, 2)])
def test_a_batch_answers_what_each_key_answers_alone(lost, gone):
    placement = RootPlacement(["/r0", "/r1", "/r2"])
    roots = roots_where(placement, lost, gone)
    alone = [on_their_roots(roots, placement, [key])[0] for key in KEYS]
    for root in roots:
        root.blockio.asked.clear()

    batch = on_their_roots(roots, placement, KEYS)

    out = {lost, gone} - {None}
    choices = [placement.choices(key) for key in KEYS]
    # Found (True), looked for everywhere and not found (False), or not found
    # where one of its roots was lost or gone (None: nobody looked there).
    expected = [
        True
        if (i % 3 == 0 and c[0] not in out) or (i % 3 == 1 and c[1] not in out)
        else (None if out & set(c) else False)
        for i, c in enumerate(choices)
    ]
    assert batch == alone == expected and any(expected)
    assert (None in expected) == bool(out)
    for index, root in enumerate(roots):
        had_at_home = [
            c[0] not in out and k in roots[c[0]].blockio.present for k, c in zip(KEYS, choices)
        ]
        should_ask = [
            k
            for k, c, home in zip(KEYS, choices, had_at_home)
            if c[0] == index or (c[1] == index and not home)
        ]
        asked = root.blockio.asked
        assert sorted(asked) == ([] if index == lost else sorted(should_ask))


def test_one_root_and_an_empty_batch():
    placement = RootPlacement(["/r0"])
    roots = [SimpleNamespace(lost=False, blockio=Checks({KEYS[0]}))]
    assert on_their_roots(roots, placement, KEYS[:3]) == [True, False, False]
    assert on_their_roots(roots, placement, []) == []
    roots[0].lost = True
    assert on_their_roots(roots, placement, KEYS[:3]) == [None, None, None]  # unknown


def test_a_check_that_ran_out_of_time_answers_a_prefix():
    """Roots whose budgeted checks answer 10 keys at most: the batch answers
    the keys before the first one any root left -- exactly what the full
    batch answers for them, one key at least -- and one root alone its 10."""
    placement = RootPlacement(["/r0", "/r1", "/r2"])
    full = on_their_roots(roots_where(placement, None, None), placement, KEYS)
    roots = roots_where(placement, None, None)
    for root in roots:
        root.blockio.budget_keys = 10
    budgeted = functools.partial(at_once, budget_s=1.0)

    part = on_their_roots(roots, placement, KEYS, budgeted)

    at_home = [[i for i, k in enumerate(KEYS) if placement.choices(k)[0] == r] for r in range(3)]
    assert 1 <= len(part) <= min(members[10] for members in at_home)
    assert part == full[: len(part)]
    one = [SimpleNamespace(lost=False, blockio=Checks(set(KEYS), budget_keys=10))]
    assert on_their_roots(one, RootPlacement(["/r0"]), KEYS, budgeted) == [True] * 10
