"""``llmkv-fs bench --plot-dir``'s pictures show every word: each plot is
rendered (matplotlib Agg) and no text -- title, subtitle, tick labels,
axis labels, legend entries -- leaves the figure or lies on another one.
From the saved result (docs/bench/tiers.json) and from the run a new user
makes first: tmpfs, one thread count, no fio (the physical reference is
then "python O_DIRECT/psync (physical)", the longest legend entry). No vLLM."""

from __future__ import annotations

import json

import pytest

from llmkv_fs.harness import bench_report
from tests.kits import REPO

pytest.importorskip("matplotlib")

from tests.kits.plot_kit import text_problems

SAVED = REPO / "docs" / "bench" / "tiers.json"


def saved_result() -> dict:
    return json.loads(SAVED.read_text())


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_all draws, as it draws them."""
    figures = []
    draw = bench_report.plot_one

    def keep(*args):
        figures.append(draw(*args))
        return figures[-1]

    monkeypatch.setattr(bench_report, "plot_one", keep)
    return figures


def assert_every_word_shows(figures) -> None:
    assert figures
    problems = [problem for fig in figures for problem in text_problems(fig)]
    assert problems == []


def test_the_saved_runs_plots_show_every_word(tmp_path, drawn):
    written = bench_report.plot_all(saved_result(), str(tmp_path))
    assert len(written) == len(drawn) == 6
    assert_every_word_shows(drawn)


def first_run_on_tmpfs() -> dict:
    """One medium, one thread count, the python reference instead of fio."""
    result = saved_result()
    case = result["cases"][0]
    assert case["fs"]["fstype"] == "tmpfs"
    case["reference"]["tool"] = "python"
    result["cases"] = [case]
    return result


def test_a_long_legend_entry_stays_inside(tmp_path, drawn):
    bench_report.plot_all(first_run_on_tmpfs(), str(tmp_path))
    labels = {text.get_text() for fig in drawn for text in fig.axes[0].get_legend().get_texts()}
    assert "python O_DIRECT/psync (physical)" in labels
    assert_every_word_shows(drawn)


def test_a_long_machine_description_stays_inside(tmp_path, drawn):
    result = first_run_on_tmpfs()
    result["machine"]["node"] = "gpu-node-" + "a" * 60 + ".cluster.example.internal"
    result["cases"][0]["fs"]["mount"] = "/mnt/" + "deeply/nested/" * 6 + "kv-cache"
    bench_report.plot_all(result, str(tmp_path))
    assert_every_word_shows(drawn)
