"""Pause points (llmkv_fs/engine/block/pause.py) reach an engine only as its
constructor argument -- never from the environment -- and a paused engine
runs the production lookup: the compiled presence check, held at the
``exists`` point in front of it."""

from __future__ import annotations

import logging
import os

import pytest

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.engine.block.presence import compiled_check
from llmkv_fs.layout.paths import CacheLayout
from tests.kits.engine_kit import (
    BS,
    IDENTITY,
    inside,
    make_key,
    memfd_primary,
    settle,
    store_blocks,
)

# The variable that switched pause points on from outside before they became
# an argument; set here to prove nothing reads it.
_OLD_SWITCH = "LLMKV_FS_TEST_PAUSE_DIR"


@pytest.mark.parametrize("io_workers", [0, 2], ids=["threads", "workers"])
def test_the_environment_turns_no_pause_point_on(tmp_path, monkeypatch, io_workers):
    """A directory that arms every point, named in the environment: an
    engine started without ``pause`` holds nothing, in threads and workers."""
    armed = tmp_path / "pause"
    armed.mkdir()
    (armed / "armed.enter").touch()  # no "open" file: a paused block would wait
    monkeypatch.setenv(_OLD_SWITCH, str(armed))
    root = str(tmp_path / "kv")
    settings = TierSettings(root_dir=root, io_workers=io_workers, lookup_threads=1)
    primary = memfd_primary(4 * BS)
    engine = FsEngine(settings, CacheLayout.for_identity(root, IDENTITY), primary, BS)
    try:
        assert inside(engine).pause is None
        assert engine.io_workers == io_workers
        store_blocks(engine, primary, 1, [0, 1], [0, 1])  # waits for the jobs: none held
        assert not [name for name in os.listdir(armed) if name.startswith("at.")]
    finally:
        engine.shutdown()


def test_a_paused_engine_runs_the_compiled_check(tmp_path, engines, gate_for, caplog):
    """The engines the test kits start carry pause points, and their lookups
    still check chunks in the compiled call; a check held at ``exists``
    answers once let go."""
    if compiled_check() is None:
        pytest.skip("the compiled presence check is not built here (or no openat2)")
    with caplog.at_level(logging.INFO, logger="vllm.llmkv_fs.engine"):
        engine, _layout, primary = engines(str(tmp_path / "kv"), n_blocks=4, lookup_threads=1)
    assert inside(engine).pause is not None
    started = [r.getMessage() for r in caplog.records if "presence check" in r.getMessage()]
    assert len(started) == 1 and started[0].split("presence check ")[1].startswith("compiled")

    store_blocks(engine, primary, 1, [0], [0])
    gate = gate_for(engine, kinds=("lookup",), point="exists")
    stored, absent = make_key(0), make_key(1)
    assert engine.lookup(stored, "r") is None
    assert engine.lookup(absent, "r") is None
    engine.end_step()
    gate.wait_entered(1)  # the chunk's first key, before the chunk's one call
    assert [key for _place, _op, key in gate.entries] == [stored]
    assert engine.lookup(stored, "r") is None  # held: no verdict yet
    gate.open()
    assert settle(engine, stored, "r") is True
    assert settle(engine, absent, "r") is False
    assert [key for _place, _op, key in gate.entries] == [stored, absent]  # each key, in order
