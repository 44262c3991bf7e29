"""A root list split and checked (``llmkv_fs/rootlist.py``): by spelling
first (empty, repeated, nested, too many entries), then against the
filesystem (one directory through a link, nested once links are resolved,
an entry not made yet judged by its nearest existing ancestor). Each error
names the key and the entry."""

from __future__ import annotations

import os

import pytest

from llmkv_fs.checks import TierConfigError
from llmkv_fs.rootlist import (
    MAX_ROOTS,
    RootListError,
    check_roots_distinct,
    first_overlap,
    root_identity,
    split_root_list,
)


def test_entries_are_split_on_commas_and_stripped_in_order():
    assert split_root_list("root_dir", " /b/kv , /a/kv,/c ") == ("/b/kv", "/a/kv", "/c")
    assert split_root_list("root_dir", "/one") == ("/one",)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("/a,,/b", "entry 2 is empty"),
        ("/a,", "entry 2 is empty"),
        ("/a/kv,/a/kv/", "entry 2 '/a/kv/' names the same directory as entry 1 '/a/kv'"),
        ("/a/kv,/a/kv/inner", "entry 2 '/a/kv/inner' lies inside entry 1 '/a/kv'"),
        ("/a/kv/inner,/a/kv", "entry 1 '/a/kv/inner' lies inside entry 2 '/a/kv'"),
    ],
)
def test_a_bad_spelling_is_refused_naming_key_and_entry(text, says):
    with pytest.raises(RootListError) as raised:
        split_root_list("root_dir", text)
    assert "root_dir" in str(raised.value) and says in str(raised.value)
    assert isinstance(raised.value, TierConfigError)


def test_siblings_sharing_a_prefix_are_separate_trees():
    assert split_root_list("root_dir", "/a/kv,/a/kv2") == ("/a/kv", "/a/kv2")
    assert first_overlap(["/a/kv", "/a/kv2"]) is None


def test_more_than_the_maximum_is_refused():
    roots = ",".join(f"/r{i}" for i in range(MAX_ROOTS))
    assert len(split_root_list("root_dir", roots)) == MAX_ROOTS
    with pytest.raises(RootListError, match=f"lists {MAX_ROOTS + 1} directories"):
        split_root_list("root_dir", roots + ",/one-more")


def test_a_root_is_placed_by_its_normalised_spelling():
    assert root_identity("/mnt//a/./kv/") == root_identity("/mnt/a/kv") == "/mnt/a/kv"


def test_one_directory_through_a_symlink_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(RootListError, match="are the same directory"):
        check_roots_distinct("root_dir", [str(tmp_path / "real"), str(tmp_path / "link")])


def test_nested_once_links_are_resolved_even_before_it_exists(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").symlink_to(tmp_path / "a")
    later = str(tmp_path / "b" / "not-made-yet" / "kv")
    with pytest.raises(RootListError, match=r"entry 2 .* lies inside entry 1"):
        check_roots_distinct("root_dir", [str(tmp_path / "a"), later])
    assert not os.path.lexists(tmp_path / "a" / "not-made-yet")  # nothing created


def test_separate_directories_pass(tmp_path):
    (tmp_path / "a").mkdir()
    check_roots_distinct("root_dir", [str(tmp_path / "a"), str(tmp_path / "b" / "kv")])
