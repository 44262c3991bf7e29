"""Our on-disk layout is vLLM 0.33's FileMapper layout, byte for byte.

Every comparison builds the real ``TieringOffloadingSpec`` and asks vLLM's
``FileMapper`` exactly the way its built-in ``fs`` tier does
(``from_offloading_spec(..., blocks_per_file=spec.blocks_per_chunk,
parallel_agnostic=True)``), then asks our ``CacheLayout`` the same questions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import socket

import pytest
from vllm.v1.kv_offload.config import OffloadingCacheConfig
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from llmkv_fs.layout.names import parse_temp_name, safe_model_component
from llmkv_fs.layout.paths import CacheLayout, LayoutError, RunIdentity
from tests.kits.layout_kit import (
    KEYS,
    ONE_GROUP,
    ROOT,
    TWO_GROUPS,
    assert_same_layout,
    our_layout,
    spec_for,
    vllm_mapper,
)
from tests.kits.names_kit import temp_path
from tests.kits.tier_kit import offloading_config


def _matrix():
    cases = []
    for tp, rank_kind, agnostic, replicated, groups, model, dtype in itertools.product(
        (1, 2, 4),
        ("rank0", "rankN"),
        (False, True),
        (False, True),
        ("one_group", "two_groups"),
        ("meta-llama/Llama-3.1-8B-Instruct", "plainmodel"),
        ("bfloat16", "float16"),
    ):
        if tp == 1 and rank_kind == "rankN":
            continue
        rank = 0 if rank_kind == "rank0" else tp - 1
        cases.append(
            pytest.param(
                tp,
                rank,
                agnostic,
                replicated,
                groups,
                model,
                dtype,
                id=f"tp{tp}-r{rank}-{'ag' if agnostic else 'noag'}-"
                f"{'repl' if replicated else 'norepl'}-{groups}-{model.replace('/', '_')}-{dtype}",
            )
        )
    return cases


@pytest.mark.parametrize("tp,rank,agnostic,replicated,groups,model,dtype", _matrix())
def test_layout_equals_vllm_file_mapper(tp, rank, agnostic, replicated, groups, model, dtype):
    spec = spec_for(
        tp_size=tp,
        rank=rank,
        agnostic=agnostic,
        replicated_layout=replicated,
        groups=ONE_GROUP if groups == "one_group" else TWO_GROUPS,
        model=model,
        dtype=dtype,
    )
    layout = assert_same_layout(spec)

    collapsed = agnostic or replicated
    expected_rank = 0 if collapsed else rank
    assert layout.rank_dir == f"{layout.base_path}_r{expected_rank}"
    assert all(
        layout.block_path(k).startswith(f"{layout.base_path}_r{expected_rank}/") for k in KEYS
    )
    # The run config records the real parallelism only when not collapsed.
    assert layout.run_config["tp_size"] == (1 if collapsed else tp)
    assert ("parallel_agnostic" in layout.run_config) is (not collapsed)
    assert layout.run_config.get("replicated_layout", False) is replicated
    assert layout.run_config["dtype"] == dtype
    assert len(layout.run_config["kv_cache_groups"]) == (1 if groups == "one_group" else 2)
    assert os.path.basename(layout.base_path).startswith(model.replace("/", "_") + "_")


@pytest.mark.parametrize("variant", ["blocks_per_chunk_4", "tokens_per_hash_32", "canonical"])
def test_layout_equals_vllm_for_non_default_cache_and_canonical(variant):
    cfg = offloading_config(tiers=[], groups=TWO_GROUPS, tp_size=2, rank=1, agnostic=True)
    if variant == "blocks_per_chunk_4":
        cfg = dataclasses.replace(
            cfg, cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4)
        )
    elif variant == "tokens_per_hash_32":
        cfg = dataclasses.replace(
            cfg, cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1)
        )
    else:
        cfg = dataclasses.replace(cfg, canonical_layout=True, kv_cache_layout="LBNHC")
    spec = TieringOffloadingSpec(cfg)
    layout = assert_same_layout(spec)
    default = our_layout(spec_for(groups=TWO_GROUPS, tp_size=2, rank=1, agnostic=True))
    assert layout.base_path != default.base_path
    if variant == "canonical":
        assert "canonical_format" in layout.run_config


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1), (4, 3)])
def test_agnostic_and_non_agnostic_digests_differ(tp, rank):
    agnostic = our_layout(spec_for(tp_size=tp, rank=rank, agnostic=True))
    strict = our_layout(spec_for(tp_size=tp, rank=rank, agnostic=False))
    assert agnostic.digest != strict.digest
    assert agnostic.base_path != strict.base_path
    assert agnostic.rank_dir.endswith("_r0")
    assert strict.rank_dir.endswith(f"_r{rank}")
    # vLLM agrees on both.
    assert (
        vllm_mapper(spec_for(tp_size=tp, rank=rank, agnostic=True)).base_path == agnostic.base_path
    )
    assert (
        vllm_mapper(spec_for(tp_size=tp, rank=rank, agnostic=False)).base_path == strict.base_path
    )


def test_agnostic_configs_of_different_tp_share_one_directory():
    paths = {
        our_layout(spec_for(tp_size=tp, rank=r, agnostic=True)).block_path(KEYS[0])
        for tp, r in [(1, 0), (2, 1), (4, 2)]
    }
    assert len(paths) == 1
    strict = {
        our_layout(spec_for(tp_size=tp, rank=r)).base_path for tp, r in [(1, 0), (2, 1), (4, 2)]
    }
    assert len(strict) == 3


@pytest.mark.parametrize("rank", [1, 3])
def test_agnostic_rank_dir_is_r0_for_nonzero_rank(rank):
    spec = spec_for(tp_size=4, rank=rank, agnostic=True)
    layout = our_layout(spec)
    assert layout.rank == 0
    assert layout.rank_dir == f"{layout.base_path}_r0"
    assert layout.block_path(KEYS[2]) == vllm_mapper(spec).get_file_name(KEYS[2])
    assert f"_r{rank}/" not in layout.block_path(KEYS[2])


@pytest.mark.parametrize("root", ["/abs/root", "/abs/trailing/", "rel/dir", "./rel", "a/b/../c"])
def test_base_path_matches_vllm_for_root_spellings(root):
    assert_same_layout(spec_for(), root)


@pytest.mark.parametrize("root", [".", "/"])
def test_base_path_matches_vllm_for_cwd_and_filesystem_root(root):
    assert_same_layout(spec_for(), root)


# -- model names ---------------------------------------------------------------------


def test_nul_in_model_name_is_refused():
    with pytest.raises(LayoutError, match="NUL"):
        safe_model_component("acme/model\0evil")
    layout = our_layout(spec_for(model="acme/model\0evil"))
    with pytest.raises(LayoutError):
        layout.base_path  # noqa: B018


def test_overlong_model_name_is_refused():
    name = "m" * 300
    with pytest.raises(LayoutError, match="too long"):
        safe_model_component(name)
    with pytest.raises(LayoutError):
        our_layout(spec_for(model=name)).config_path  # noqa: B018


def test_longest_accepted_model_name_fits_a_path_component():
    # The longest name accepted still gives components within NAME_MAX.
    longest = None
    for n in range(200, 260):
        try:
            safe_model_component("m" * n)
        except LayoutError:
            break
        longest = n
    assert longest is not None and longest < 300
    layout = our_layout(spec_for(model="m" * longest))
    assert all(len(part.encode()) <= 255 for part in layout.block_path(KEYS[0]).split("/"))
    assert layout.base_path == vllm_mapper(spec_for(model="m" * longest)).base_path


def test_accepted_name_fits_for_two_digit_rank():
    longest = max(n for n in range(200, 260) if _accepted("m" * n))
    identity = RunIdentity("m" * longest, "bfloat16", 16, 1, ONE_GROUP, tp_size=16, rank=10)
    layout = CacheLayout.for_identity(ROOT, identity)
    try:
        parts = layout.block_path(KEYS[0]).split("/")
    except LayoutError:
        return
    assert all(len(p.encode()) <= 255 for p in parts)


def _accepted(name: str) -> bool:
    try:
        safe_model_component(name)
        return True
    except LayoutError:
        return False


@pytest.mark.parametrize("name", ["../../etc", "/abs/path", "..", ".", "../", "a/../../b", ""])
@pytest.mark.parametrize("root", ["/mnt/kvcache", "/mnt/kvcache/"])
def test_hostile_model_names_stay_inside_root_and_match_vllm(name, root):
    spec = spec_for(model=name)
    layout = our_layout(spec, root)
    base = layout.base_path
    assert os.path.dirname(os.path.normpath(base)) == os.path.normpath(root)
    assert os.path.dirname(os.path.normpath(layout.config_path)) == os.path.normpath(base)
    for key in KEYS:
        block = os.path.normpath(layout.block_path(key))
        assert block.startswith(os.path.normpath(root) + "/")
        assert ".." not in block.split("/")
    assert base == vllm_mapper(spec, root).base_path
    assert layout.block_path(KEYS[0]) == vllm_mapper(spec, root).get_file_name(KEYS[0])


# -- temp names ----------------------------------------------------------------------


HOSTS = [
    "node-1",
    "a",
    "node-1.cluster.local",
    "ip-10-0-0-1.ec2.internal",
]


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("pid,nonce", [(1, "0"), (4194304, "1f3a"), (77, "k3x9z")])
@pytest.mark.parametrize(
    "final", ["/mnt/kv/m_abc_r0/abc/de_g0/abcdef0123.bin", "/mnt/kv/m_abc/config.json"]
)
def test_temp_path_round_trips(host, pid, nonce, final):
    path = temp_path(final, host, pid, nonce)
    assert os.path.dirname(path) == os.path.dirname(final)
    name = os.path.basename(path)
    assert name.startswith(".")
    assert name.endswith(".tmp")
    parsed = parse_temp_name(name)
    assert parsed is not None
    assert (parsed.host, parsed.pid, parsed.nonce) == (host, pid, nonce)


def test_real_hostname_round_trips():
    host = socket.gethostname()
    parsed = parse_temp_name(os.path.basename(temp_path("/r/x.bin", host, os.getpid(), "ab1")))
    assert parsed is not None and parsed.pid == os.getpid() and parsed.nonce == "ab1"
    if "." not in host:
        assert parsed.host == host


@pytest.mark.parametrize(
    "name",
    [
        hashlib.sha256(b"x").hexdigest() + ".bin",
        "config.json",
        "random",
        "",
        ".hidden",
        "x.tmp",
        ".tmp",
        ".a.host~notapid~ab.tmp",
        ".a.host~12~AB.tmp",  # nonce is lower-case base36
        ".a.host~12~ab.tmp.bin",
        "a.host~12~ab.tmp",  # not hidden
        ".a.ho/st~12~ab.tmp",
        ".a.host~12.tmp",
    ],
)
def test_parse_temp_name_rejects_other_names(name):
    assert parse_temp_name(name) is None


def test_a_pid_started_after_its_lease_is_a_reused_pid():
    """Liveness comes from psutil: our own pid is alive for a lease written
    now, but not for one written before this process started (another
    process had the pid then), nor is a zombie."""
    import subprocess
    import sys
    import time

    from llmkv_fs.volume.leases import pid_alive

    assert pid_alive(os.getpid())
    assert pid_alive(os.getpid(), started_by_ns=time.time_ns())
    assert not pid_alive(os.getpid(), started_by_ns=time.time_ns() - 86_400 * 10**9)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while pid_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling: the child exits by itself and stays a zombie
    assert not pid_alive(child.pid)  # exited, not reaped yet: a zombie is dead
    child.wait()
    assert not pid_alive(child.pid)
