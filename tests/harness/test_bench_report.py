"""``llmkv-fs bench``'s plots, drawn from a saved result (docs/bench/tiers.json):
matplotlib (the ``[bench]`` extra) draws one PNG per medium, block size and
direction; without it the plots are skipped with a message naming the fix.
No vLLM needed."""

import json
import os
import struct
import sys

import pytest

from llmkv_fs.harness import bench_report
from tests.kits import REPO

SAVED = REPO / "docs" / "bench" / "tiers.json"


def saved_result() -> dict:
    return json.loads(SAVED.read_text())


def png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_one_plot_per_medium_block_size_and_direction(tmp_path):
    pytest.importorskip("matplotlib")
    written = bench_report.plot_all(saved_result(), str(tmp_path))
    # The same files as the figures docs/benchmarks.md shows.
    assert sorted(map(os.path.basename, written)) == sorted(
        p.name for p in SAVED.parent.glob("bench_*.png")
    )
    assert {png_size(p) for p in written} == {(1100, 600)}


def test_a_single_thread_count_still_plots(tmp_path):
    pytest.importorskip("matplotlib")
    result = saved_result()
    result["cases"] = result["cases"][:1]
    for case in result["cases"]:
        case["reference"] = None  # and no physical reference either
    written = bench_report.plot_all(result, str(tmp_path))
    assert len(written) == 2 and all(png_size(p) == (1100, 600) for p in written)


def test_without_matplotlib_plots_are_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert "llmkv-fs[bench]" in bench_report.plotting_missing()
    assert bench_report.plot_all(saved_result(), str(tmp_path / "plots")) == []
    err = capsys.readouterr().err
    assert "plots skipped: matplotlib is not installed" in err and "llmkv-fs[bench]" in err
    assert not (tmp_path / "plots").exists()
