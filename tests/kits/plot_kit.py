"""What a reader of a plot must be able to read: every word inside the
picture and none on top of another. Works on a drawn matplotlib Figure
(Agg: no display needed)."""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.transforms import Bbox

_SLACK_PX = 0.5  # a glyph's box may touch its neighbour's or the edge


def words(fig: Figure) -> list[tuple[str, Bbox]]:
    """(text, window extent) of every text the figure draws (tick labels,
    titles, legend entries, footnotes...): recorded while it draws, so a
    tick label out of view, which is never drawn, is not counted."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    drawn: list[tuple[str, Bbox]] = []
    draw = Text.draw

    def recording(text: Text, renderer) -> None:
        draw(text, renderer)
        if text.get_visible() and text.get_text().strip():
            drawn.append((text.get_text(), text.get_window_extent(renderer)))

    Text.draw = recording  # type: ignore[method-assign]
    try:
        canvas.draw()
    finally:
        Text.draw = draw  # type: ignore[method-assign]
    return drawn


def text_problems(fig: Figure) -> list[str]:
    """Each text outside the figure, and each pair of texts that overlap."""
    edge = fig.bbox
    placed = words(fig)
    problems = []
    for text, box in placed:
        if (
            box.x0 < edge.x0 - _SLACK_PX
            or box.y0 < edge.y0 - _SLACK_PX
            or box.x1 > edge.x1 + _SLACK_PX
            or box.y1 > edge.y1 + _SLACK_PX
        ):
            problems.append(f"{text!r} leaves the figure: {box.bounds} not in {edge.bounds}")
    for i, (text, box) in enumerate(placed):
        for other, other_box in placed[i + 1 :]:
            x = min(box.x1, other_box.x1) - max(box.x0, other_box.x0)
            y = min(box.y1, other_box.y1) - max(box.y0, other_box.y0)
            if x > _SLACK_PX and y > _SLACK_PX:
                problems.append(f"{text!r} overlaps {other!r}")
    return problems
