"""Several roots in the benchmarks (issue 19): how ``llmkv-fs bench`` and
``tools/bench/engine.py`` read a comma list of roots, and the table of a
saved multi-root result. No vLLM, no I/O."""

import json

import pytest

from llmkv_fs.harness import bench_report
from llmkv_fs.harness.bench import add_root_scaling
from llmkv_fs.harness.bench_media import roots_of
from tests.kits import REPO
from tools.bench.engine_cli import media_of

DOCS = REPO / "docs" / "bench"


def test_a_comma_list_is_one_medium_of_several_roots():
    assert roots_of("/a") == ["/a"]
    assert roots_of("/a,/b") == ["/a", "/b"]
    with pytest.raises(SystemExit, match="lies inside"):  # the tier's rules
        roots_of("/a,/a/b")
    for bad in ("/a,,/b", "/a,", ","):
        with pytest.raises(SystemExit, match="is empty"):
            roots_of(bad)
        with pytest.raises(SystemExit, match="is empty"):
            media_of([bad], [])
    assert media_of(["/a", "/b,/c"], []) == [("/a",), ("/b", "/c")]
    assert media_of(["/a", "/b,/c"], [1, 3]) == [("/a", "/b", "/c")]
    with pytest.raises(SystemExit, match=r"1\.\.3"):
        media_of(["/a", "/b,/c"], [4])


def test_several_roots_get_their_table_against_one_root():
    result = json.loads((DOCS / "issue19_2core_bench.json").read_text())
    for case in result["cases"]:
        case.pop("vs_one_root", None)
    add_root_scaling(result["cases"])
    two = next(c for c in result["cases"] if len(c["roots"]) == 2 and c["threads"] == 2)
    one = next(c for c in result["cases"] if c["roots"] == two["roots"][:1] and c["threads"] == 2)
    ours = two["tiers"]["ours"]["store"]["gbps"] / one["tiers"]["ours"]["store"]["gbps"]
    assert two["vs_one_root"]["store"] == pytest.approx(ours)
    table = bench_report.markdown(result)
    assert "### Several roots" in table and "ext4+ext4" in table
    # A result saved before several roots renders as before.
    old = bench_report.markdown(json.loads((DOCS / "tiers.json").read_text()))
    assert "Several roots" not in old
