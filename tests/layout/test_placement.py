"""Placement over several roots: deterministic, independent of the list's
order, and moving only what must move when a root is added or removed."""

import collections
import itertools

import pytest

from llmkv_fs.checks import TierConfigError
from llmkv_fs.config import TierSettings
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.rootlist import MAX_ROOTS, RootListError, split_root_list
from tests.kits.engine_kit import make_key

KEYS = [make_key(i) for i in range(20_000)]
ROOTS = ["/mnt/nvme0/kv", "/mnt/nvme1/kv", "/mnt/nvme2/kv"]


def homes(roots: list[str]) -> dict[bytes, str]:
    placement = RootPlacement(roots)
    return {key: roots[placement.home(key)] for key in KEYS}


def test_blocks_spread_evenly_over_the_roots():
    counts = collections.Counter(homes(ROOTS).values())
    assert set(counts) == set(ROOTS)
    for root in ROOTS:  # 20,000 keys over 3 roots: each within 5 % of a third
        assert abs(counts[root] - len(KEYS) / 3) < 0.05 * len(KEYS) / 3, counts


def test_reordering_the_list_moves_no_block():
    first = homes(ROOTS)
    for order in itertools.permutations(ROOTS):
        assert homes(list(order)) == first


def test_the_spelling_of_a_root_does_not_change_its_blocks():
    respelled = RootPlacement(["/mnt/nvme0/kv/", "/mnt/nvme1//kv", "/mnt/./nvme2/kv"])
    placement = RootPlacement(ROOTS)
    assert all(respelled.home(key) == placement.home(key) for key in KEYS)


def test_adding_a_root_moves_a_share_of_blocks_to_it_and_their_second_choice_is_the_old_home():
    before = homes(ROOTS)
    grown = [*ROOTS, "/mnt/nvme3/kv"]
    placement = RootPlacement(grown)
    moved = 0
    for key in KEYS:
        home, second = (grown[i] for i in placement.choices(key))
        if home != before[key]:
            moved += 1
            assert home == "/mnt/nvme3/kv"  # only to the new root
            assert second == before[key]  # where a load still finds it
    assert 0.22 < moved / len(KEYS) < 0.28, moved  # about 1/4


def test_removing_a_root_moves_only_its_blocks():
    before = homes([*ROOTS, "/mnt/nvme3/kv"])
    after = homes(ROOTS)
    for key in KEYS:
        if before[key] != "/mnt/nvme3/kv":
            assert after[key] == before[key]


def test_one_root_is_always_home():
    placement = RootPlacement(["/kv"])
    assert {placement.home(k) for k in KEYS[:100]} == {0}
    assert placement.choices(KEYS[0]) == (0,)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("/a,,/b", "entry 2 is empty"),
        (",/a", "entry 1 is empty"),
        ("/a, ", "entry 2 is empty"),
        ("/a,/b,/a/", "entry 3 '/a/' names the same directory as entry 1 '/a'"),
        ("/a/b,/a", "entry 1 '/a/b' lies inside entry 2 '/a'"),
        ("/a,/a/./b", "entry 2 '/a/./b' lies inside entry 1 '/a'"),
        (",".join(f"/r{i}" for i in range(MAX_ROOTS + 1)), f"at most {MAX_ROOTS}"),
    ],
)
def test_a_bad_root_list_is_refused_naming_the_entry(text, words):
    with pytest.raises(RootListError, match="root_dir") as info:
        TierSettings.from_mapping({"root_dir": text, "path_sharding": "by_block_hash"})
    assert words in str(info.value)
    assert isinstance(info.value, TierConfigError)


def test_a_list_keeps_its_order_and_drops_spaces_around_entries():
    assert split_root_list("root_dir", " /a , /b,/c ") == ("/a", "/b", "/c")


def test_without_path_sharding_a_comma_is_part_of_the_one_root():
    settings = TierSettings.from_mapping({"root_dir": "/data/a,b"})
    assert settings.root_dirs == ("/data/a,b",)


def test_path_sharding_takes_only_known_values():
    with pytest.raises(TierConfigError, match="path_sharding"):
        TierSettings.from_mapping({"root_dir": "/a,/b", "path_sharding": "by_key"})
