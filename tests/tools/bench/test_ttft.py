"""tools/bench/ttft.py (issue 26: recompute against a KV hit from a tier)
on the CPU with the tiny shape: the shape table's KV sizes, every case of a
run in its JSON with every byte compared, a byte flipped on disk between
store and load reported as a failure (ours refuses the block, vLLM's
built-in serves it and the comparison catches it), skipped cases named, the
tables rendered. With vLLM's built-in payload (``$LLMKV_BENCH_PAYLOAD`` or
``.bench_payload``, made by tools/bench/builtin_payload.py) its side runs
too, else those tests skip. No timing is asserted."""

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from tests.kits import REPO
from tools.bench import ttft, ttft_shapes
from tools.bench.ttft_plot import merge, render_tables

PAYLOAD = os.environ.get("LLMKV_BENCH_PAYLOAD") or str(REPO / ".bench_payload")
MiB, KiB = 1 << 20, 1 << 10


def test_kv_bytes_per_token_and_chunk_sizes_of_the_shape_table():
    llama8b, llama1b = ttft_shapes.SHAPES["llama-3.1-8b"], ttft_shapes.SHAPES["llama-3.2-1b"]
    assert llama8b.kv_bytes_per_token == 131072
    assert llama1b.kv_bytes_per_token == 32768
    assert llama8b.chunk_bytes(16) == 2 * MiB
    assert llama8b.chunk_bytes(256) == 32 * MiB
    assert llama1b.chunk_bytes(16) == 512 * KiB
    assert ttft_shapes.SHAPES["tiny"].chunk_bytes(16) == 4 * KiB  # one page: O_DIRECT-able
    assert ttft_shapes.resolve_shape("Llama-3.1-8B") is llama8b


@pytest.fixture
def shm_dir():
    path = f"/dev/shm/llmkv_ttft_test_{uuid.uuid4().hex[:10]}"
    os.makedirs(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(tmp_path, dirs, *extra):
    pytest.importorskip("torch")
    out = tmp_path / "ttft.json"
    argv = ["--device", "cpu", "--shape", "tiny", "--lengths", "256,512"]
    argv += ["--chunk-tokens", "16,64", "--rounds", "1", "--recompute", "torch"]
    argv += ["--settle-s", "0", "--read-threads", "2", "--json", str(out), *extra]
    for d in dirs:
        argv += ["--dir", d]
    rc = ttft.main(argv)
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("io_workers", ["0", "2"], ids=["threads", "workers"])
def test_every_case_is_measured_and_every_byte_compared(tmp_path, shm_dir, io_workers):
    rc, result = _run(tmp_path, [shm_dir], "--io-workers", io_workers)
    assert rc == 0 and result["ok"]
    cases = result["cases"]
    assert sorted((c["chunk_tokens"], c["tokens"]) for c in cases) == [
        (16, 256),
        (16, 512),
        (64, 256),
        (64, 512),
    ]
    for case in cases:
        ours = case["ours"]
        assert case["status"] == "ok" and ours["status"] == "ok"
        assert case["chunks"] == case["tokens"] // case["chunk_tokens"]
        assert case["kv_bytes"] == case["tokens"] * 256
        assert ours["info"]["io_workers"] == int(io_workers)
        assert ours["info"]["checksum"] is True
        # compared on the "GPU" or the case would have failed
        assert len(ours["rounds"]) == 1 and ours["rounds"][0]["steps"] >= 1
        assert ours["total_s"] >= ours["lookup_s"] + ours["load_s"]
        assert ours["page_cache"].startswith("not droppable")  # tmpfs
        assert case["recompute"]["status"] == "ok" and case["recompute"]["s"] > 0
        assert "builtin" not in case and "plain_read" not in case
    assert result["builtin"].startswith("not run")
    assert set(result["recompute"]["tiny"]["lengths"]) == {"256", "512"}
    assert os.listdir(shm_dir) == []  # the tier's directories are gone
    table = render_tables(result)
    assert "### tiny, 16-token chunks (4 KiB)" in table and "### tiny, 64-token chunks" in table
    assert table.count("\n| 256 | 0.00 |") == 2


def test_on_disk_a_plain_read_of_the_same_files_is_the_reference(tmp_path):
    rc, result = _run(tmp_path, [str(tmp_path / "disk")], "--lengths", "256", "--rounds", "2")
    assert rc == 0 and result["ok"]
    for case in result["cases"]:
        assert case["ours"]["page_cache"].startswith("dropped")
        assert len(case["ours"]["rounds"]) == 2
        read = case["plain_read"]
        assert {s["o_direct"] for s in read["samples"]} == {True, False}
        assert read["gbps"] > 0 and read["best"]["threads"] == 2
    assert "%" in render_tables(result)


def test_a_byte_flipped_between_store_and_load_fails_the_run(tmp_path, shm_dir):
    rc, result = _run(tmp_path, [shm_dir, str(tmp_path / "disk")], "--tamper")
    assert rc == 1 and not result["ok"]
    assert len(result["cases"]) == 8
    for case in result["cases"]:
        assert case["status"] == "failed"
        assert case["ours"]["status"] == "failed"
        assert "load job:" in case["ours"]["reason"]
        assert "bad-checksum" in case["ours"]["reason"]  # its checksum refused the block
    assert "| failed |" in render_tables(result)


def test_cases_beyond_the_limits_are_skipped_and_named(tmp_path, shm_dir):
    rc, result = _run(tmp_path, [shm_dir], "--max-gib", "0.0001", "--recompute", "off")
    assert rc == 0 and result["ok"]
    reasons = {c["tokens"]: c["reason"] for c in result["cases"] if c["status"] == "skipped"}
    assert set(reasons) == {512} and "--max-gib" in reasons[512]
    assert "skipped: KV" in render_tables(result)


@pytest.mark.skipif(
    not os.path.exists(os.path.join(PAYLOAD, "MANIFEST.json")),
    reason="no payload of vLLM's built-in fs tier (python -m tools.bench.builtin_payload)",
)
@pytest.mark.parametrize("tamper", [False, True], ids=["intact", "flipped"])
def test_vllm_builtin_side_runs_beside_ours(tmp_path, shm_dir, tamper):
    """In a fresh process: the payload's vllm package must come first."""
    pytest.importorskip("torch")
    out = tmp_path / "ttft.json"
    cmd = [sys.executable, "-m", "tools.bench.ttft", "--device", "cpu", "--shape", "tiny"]
    cmd += ["--lengths", "256", "--chunk-tokens", "16", "--rounds", "1", "--settle-s", "0"]
    cmd += ["--recompute", "off", "--dir", shm_dir, "--builtin", PAYLOAD, "--json", str(out)]
    proc = subprocess.run(
        cmd + (["--tamper"] if tamper else []),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(out.read_text())
    (case,) = result["cases"]
    assert result["builtin"]["vllm_version"]
    if tamper:
        assert proc.returncode == 1, proc.stderr
        # the built-in serves the flipped byte; only the comparison sees it
        assert "builtin: loaded bytes: 1 chunk(s) differ" in case["builtin"]["reason"]
    else:
        assert proc.returncode == 0, proc.stderr
        builtin = case["builtin"]
        assert builtin["status"] == "ok" and builtin["info"]["threads"] == 16
        assert builtin["info"]["lookup"] == "fs_io_C.batch_lookup"
        assert case["ours"]["status"] == "ok"
        assert " / " in render_tables(result).split("| 256 |")[1]


def _target_case(fs, **tiers):
    case = {"shape": "llama-3.1-8b", "tokens": 32768, "chunk_tokens": 16, "chunk_bytes": 2 * MiB}
    case.update(dir=f"/{fs}", fs=fs, kv_bytes=4 << 30, chunks=2048, status="ok")
    case["recompute"] = {"status": "ok", "s": 1.344, "samples": [1.344]}
    for name, (total_s, load_gbps) in tiers.items():
        parts = {"lookup_s": 0.01, "load_s": total_s / 2, "copy_s": total_s / 2 - 0.01}
        case[name] = {"status": "ok", "total_s": total_s, "load_gbps": load_gbps, **parts}
    return case


def test_the_issues_targets_are_judged_from_the_cases_that_hold_them(tmp_path):
    disk = _target_case("ext4", ours=(0.5, 7.0))
    disk["plain_read"] = {"gbps": 10.0}
    recompute = {"llama-3.1-8b": {"lengths": {"32768": {"status": "ok", "s": 1.344}}}}
    tmpfs_run = {
        "not_in_figures": "caveat",
        "recompute": recompute,
        "cases": [_target_case("tmpfs", ours=(0.25, 20.0), builtin=(1.2, 3.5))],
        "machine": {"gpu": "H200"},
    }
    result = merge([tmpfs_run, dict(tmpfs_run, cases=[disk], recompute={})])  # two calls
    assert len(result["cases"]) == 2 and result["recompute"] == recompute
    table = render_tables(result)
    assert "5.4x faster than recompute (4x: met)" in table
    assert "4.8x faster than the built-in (4x: met)" in table
    assert "load at 70 % of a plain parallel read (80 %: NOT met)" in table
    assert "| 32768 | 4.00 | 1.344 | 0.250 (5.4x) | 1.200 (1.1x) | 4.8x |" in table
    pytest.importorskip("matplotlib")
    from tools.bench.ttft_plot import plot

    assert plot(result, str(tmp_path / "ttft.png")) == str(tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").stat().st_size > 10_000
