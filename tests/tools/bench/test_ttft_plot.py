"""tools/bench/ttft_plot.py's picture shows every word: rendered (matplotlib
Agg) from the saved runs of issue 26 (docs/bench/device/), no text -- the
footnote above all, however many lines it wraps to -- leaves the figure or
lies on another one (the footnote used to overlap the panels' axis labels)."""

from __future__ import annotations

import json

import pytest

from tests.kits import REPO
from tools.bench import ttft_plot

pytest.importorskip("matplotlib")

from tests.kits.plot_kit import text_problems

SAVED = REPO / "docs" / "bench" / "device"


@pytest.fixture
def drawn(monkeypatch):
    """The figure ``plot`` draws (kept open for the test to read)."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


def saved(*names: str) -> dict:
    return ttft_plot.merge([json.loads((SAVED / name).read_text()) for name in names])


@pytest.mark.parametrize(
    "names",
    [
        ("issue26_ttft_tmpfs_8b.json",),
        ("issue26_ttft_tmpfs_8b.json", "issue26_ttft_disk_8b.json", "issue26_ttft_tmpfs_1b.json"),
    ],
    ids=["one-panel", "merged"],
)
def test_every_word_shows(tmp_path, drawn, names):
    result = saved(*names)
    path = str(tmp_path / "ttft.png")
    assert ttft_plot.plot(result, path) == path
    (fig,) = drawn
    assert text_problems(fig) == []


def test_a_long_footnote_wraps_above_the_edge_and_below_the_panels(tmp_path, drawn):
    result = saved("issue26_ttft_tmpfs_8b.json")
    result["not_in_figures"] = " ".join([result["not_in_figures"]] * 6)
    ttft_plot.plot(result, str(tmp_path / "ttft.png"))
    (fig,) = drawn
    assert text_problems(fig) == []
