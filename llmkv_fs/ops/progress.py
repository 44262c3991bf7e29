"""The volume tools' progress line on stderr (gc's status, verify's files
checked), drawn by tqdm only when the stream is a terminal: redrawn at most
every ``every_s`` unless forced, cleared when done. Nothing is drawn before
the first ``update``. Called from one thread only (the pass's, or the
collecting thread's)."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

__all__ = ["INTERVAL_S", "Progress"]

INTERVAL_S = 0.2


class Progress:
    """``label: <text> [elapsed]`` -- or, with a ``total``, a bar of
    ``total`` things (``unit``) with the text after it."""

    def __init__(
        self,
        label: str,
        stream: TextIO | None = None,
        total: int | None = None,
        unit: str = "",
        every_s: float = INTERVAL_S,
        enabled: bool | None = None,
    ):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self._bar: tqdm | None = None

    def update(self, text: str, count: int | None = None, force: bool = False) -> None:
        """Show ``text`` (and, with a total, ``count`` things done)."""
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = self._make(text)
            if self.total is None:
                return  # drawn as made
        if self.total is None:
            self._bar.set_description_str(text, refresh=force)
        else:
            self._bar.set_postfix_str(text, refresh=False)
        # tqdm redraws only once every_s has passed
        self._bar.update(0 if count is None else count - self._bar.n)
        if force:
            self._bar.refresh()

    def done(self) -> None:
        if self._bar is not None:
            self._bar.close()  # leave=False: the line is cleared
            self._bar = None

    def _make(self, text: str) -> tqdm:
        if self.total is None:
            return tqdm(
                desc=text,
                file=self.stream,
                bar_format=f"{self.label}: {{desc}} [{{elapsed}}]",
                mininterval=self.every_s,
                leave=False,
            )
        return tqdm(
            total=self.total,
            desc=self.label,
            unit=self.unit,
            file=self.stream,
            mininterval=self.every_s,
            leave=False,
        )
