"""The volume tools' one progress line (ops/progress.py): a status line
(gc) or a bar with a total (verify), only on a terminal, cleared when done."""

from __future__ import annotations

import io

from llmkv_fs.ops.progress import Progress


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_status_line_shows_its_label_and_text_then_is_cleared():
    tty = FakeTty()
    progress = Progress("gc", tty)
    progress.update("scanning 2 digests")
    progress.update("evicting 10 blocks", force=True)
    progress.done()
    text = tty.getvalue()
    assert "\rgc: scanning 2 digests [" in text and "\rgc: evicting 10 blocks [" in text
    assert text.endswith("\r")  # cleared


def test_a_bar_counts_toward_its_total():
    tty = FakeTty()
    progress = Progress("verify", tty, total=4, unit=" files")
    progress.update("1 MB/4 MB, bad 0", 4, force=True)
    progress.done()
    assert "\rverify: " in tty.getvalue() and "| 4/4 [" in tty.getvalue()
    assert "bad 0" in tty.getvalue()


def test_nothing_is_drawn_off_a_terminal():
    pipe = io.StringIO()
    progress = Progress("gc", pipe, total=None)
    progress.update("scanning", force=True)
    progress.done()
    assert pipe.getvalue() == ""
