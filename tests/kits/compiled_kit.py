"""The optional compiled modules (engine/block/_presence.c, _bytepath.c):
whether this install built them, and the one rule for a test that needs
one -- skip where it is not built, fail instead under
``LLMKV_FS_REQUIRE_COMPILED=1`` (set by .ci/run, whose machine has a C
compiler)."""

from __future__ import annotations

import importlib
import os

import pytest

REQUIRE_ENV = "LLMKV_FS_REQUIRE_COMPILED"


def built(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def require_built(module: str) -> None:
    """Skip (or, under REQUIRE_ENV=1, fail) unless ``module`` is built."""
    if not built(module):
        message = f"{module} is not built (pip install -e . with a C compiler)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(message)
        pytest.skip(message)
