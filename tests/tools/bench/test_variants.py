"""The engine benchmark's variants (tools/bench/variants.py) and the hash
benchmark (tools/bench/hash.py) do what the docs' figures say they did: a
``site`` directory comes first on the workers' PYTHONPATH and a seal piece
is in force only while the variant's engine starts, a bad key is refused by
name, and tools/bench/hash.py prints one JSON line per case with the xxhash
it measured. No timing is asserted."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import xxhash


@pytest.fixture
def variants():
    return importlib.import_module("tools.bench.variants")


def test_a_site_variant_is_first_on_pythonpath_only_inside(variants, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/before")
    variant = variants.parse_variant(f"x41:site={tmp_path},nice=19,io_workers=16")
    assert variant.name == "x41" and variant["nice"] == "19"
    with variants.applied(variant):
        assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/before"]
    assert os.environ["PYTHONPATH"] == "/before"


def test_a_seal_piece_variant_is_in_force_only_inside(variants):
    from llmkv_fs.engine.block.options import IoOptions
    from llmkv_fs.engine.startup import io_setup

    shipped = IoOptions(4 << 20, False, False, False, True, sealed=True)
    with variants.applied(variants.parse_variant("sealed1m:seal_kib=1024")):
        assert io_setup.for_worker_processes(shipped).seal_piece == 1 << 20
        assert io_setup._SEAL_PIECE_THREADS == 1 << 20
    assert io_setup.for_worker_processes(shipped).seal_piece == 256 << 10
    assert io_setup._SEAL_PIECE_THREADS == 4 << 20


def test_an_unknown_variant_key_is_refused_by_name(variants):
    with pytest.raises(ValueError, match="'colour=red' is not one of"):
        variants.parse_variant("x:colour=red")


def test_bench_hash_reports_each_case_with_its_xxhash():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench.hash",
            "--procs",
            "1",
            "--procs",
            "2",
            "--kind",
            "hot",
            "--rounds",
            "1",
            "--seconds",
            "0.05",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(line["procs"], line["kind"]) for line in lines] == [(1, "hot"), (2, "hot")]
    assert all(line["xxhash"] == xxhash.VERSION and line["gbps_total"] > 0 for line in lines)


def test_a_slice_variant_is_in_force_only_inside(variants):
    from llmkv_fs.engine import launch

    with variants.applied(variants.parse_variant("s1m:slice_kib=1024,slice_max=16")):
        assert launch.slice_blocks(512 << 10) == (2, 1)
        assert launch.slice_blocks(16 << 10) == (16, 16)
    assert launch.slice_blocks(512 << 10) == (8, 1)
    assert launch.slice_blocks(16 << 10) == (64, 16)
