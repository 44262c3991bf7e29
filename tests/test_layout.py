"""Our on-disk layout is vLLM 0.33's FileMapper layout, byte for byte.

Every comparison builds the real ``TieringOffloadingSpec`` and asks vLLM's
``FileMapper`` exactly the way its built-in ``fs`` tier does
(``from_offloading_spec(..., blocks_per_file=spec.blocks_per_chunk,
parallel_agnostic=True)``), then asks our ``CacheLayout`` the same questions.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import itertools
import json
import os
import socket
import uuid

import pytest
from harness import Replica, builtin, offloading_config, ours
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.config import OffloadingCacheConfig
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from llmkv_fs.layout import run_config as run_config_module
from llmkv_fs.layout.paths import (
    CacheLayout,
    LayoutError,
    RunIdentity,
    parse_temp_name,
    safe_model_component,
    temp_path,
)
from llmkv_fs.layout.run_config import RunConfigMismatch, ensure_run_config, render_run_config
from llmkv_fs.tier.fs_tier import identity_from_spec

ROOT = "/mnt/kvcache"
ONE_GROUP = ((16, ("model.layers.0.self_attn", "model.layers.1.self_attn")),)
TWO_GROUPS = (
    (16, ("model.layers.0.self_attn", "model.layers.2.self_attn")),
    (32, ("model.layers.1.self_attn.sliding", "model.layers.3.self_attn.sliding")),
)
KEYS = [
    make_offload_key(hashlib.sha256(b"first").digest(), 0),
    make_offload_key(hashlib.sha256(b"second").digest(), 0),
    make_offload_key(hashlib.sha256(b"first").digest(), 1),
    make_offload_key(hashlib.sha256(b"third").digest(), 1),
    make_offload_key(b"\x00\x00\x01" + bytes(29), 0),  # leading zero nibbles
    make_offload_key(bytes.fromhex("0123456789abcdef"), 1),  # a short (8-byte) hash
    make_offload_key(hashlib.sha256(b"big-group").digest(), 0x80000001),
]


def vllm_mapper(spec: TieringOffloadingSpec, root: str = ROOT) -> FileMapper:
    """Exactly how vLLM's FileSystemTierManager builds its mapper."""
    return FileMapper.from_offloading_spec(
        root_dir=root,
        offloading_spec=spec,
        blocks_per_file=spec.blocks_per_chunk,
        parallel_agnostic=True,
    )


def our_layout(spec: TieringOffloadingSpec, root: str = ROOT) -> CacheLayout:
    return CacheLayout.for_identity(root, identity_from_spec(spec))


def spec_for(**kw) -> TieringOffloadingSpec:
    kw.setdefault("tiers", [])
    return TieringOffloadingSpec(offloading_config(**kw))


def assert_same_layout(spec: TieringOffloadingSpec, root: str = ROOT) -> CacheLayout:
    theirs = vllm_mapper(spec, root)
    mine = our_layout(spec, root)
    assert mine.base_path == theirs.base_path
    assert mine.config_path == theirs.get_config_file_path()
    assert mine.run_config == theirs.get_run_config()
    assert render_run_config(mine.run_config) == render_run_config(theirs.get_run_config())
    for key in KEYS:
        assert mine.block_path(key) == theirs.get_file_name(key), key.hex()
    return mine


def _matrix():
    cases = []
    for tp, rank_kind, agnostic, replicated, groups, model, dtype in itertools.product(
        (1, 2, 4), ("rank0", "rankN"), (False, True), (False, True),
        ("one_group", "two_groups"), ("meta-llama/Llama-3.1-8B-Instruct", "plainmodel"),
        ("bfloat16", "float16"),
    ):
        if tp == 1 and rank_kind == "rankN":
            continue
        rank = 0 if rank_kind == "rank0" else tp - 1
        cases.append(pytest.param(
            tp, rank, agnostic, replicated, groups, model, dtype,
            id=f"tp{tp}-r{rank}-{'ag' if agnostic else 'noag'}-"
               f"{'repl' if replicated else 'norepl'}-{groups}-{model.replace('/', '_')}-{dtype}",
        ))
    return cases


@pytest.mark.parametrize("tp,rank,agnostic,replicated,groups,model,dtype", _matrix())
def test_layout_equals_vllm_file_mapper(tp, rank, agnostic, replicated, groups, model, dtype):
    spec = spec_for(
        tp_size=tp, rank=rank, agnostic=agnostic, replicated_layout=replicated,
        groups=ONE_GROUP if groups == "one_group" else TWO_GROUPS, model=model, dtype=dtype,
    )
    layout = assert_same_layout(spec)

    collapsed = agnostic or replicated
    expected_rank = 0 if collapsed else rank
    assert layout.rank_dir == f"{layout.base_path}_r{expected_rank}"
    assert all(layout.block_path(k).startswith(f"{layout.base_path}_r{expected_rank}/")
               for k in KEYS)
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
        cfg = dataclasses.replace(cfg, cache=OffloadingCacheConfig(tokens_per_hash=16,
                                                                   blocks_per_chunk=4))
    elif variant == "tokens_per_hash_32":
        cfg = dataclasses.replace(cfg, cache=OffloadingCacheConfig(tokens_per_hash=32,
                                                                   blocks_per_chunk=1))
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
    assert vllm_mapper(spec_for(tp_size=tp, rank=rank, agnostic=True)).base_path == \
        agnostic.base_path
    assert vllm_mapper(spec_for(tp_size=tp, rank=rank, agnostic=False)).base_path == \
        strict.base_path


def test_agnostic_configs_of_different_tp_share_one_directory():
    paths = {our_layout(spec_for(tp_size=tp, rank=r, agnostic=True)).block_path(KEYS[0])
             for tp, r in [(1, 0), (2, 1), (4, 2)]}
    assert len(paths) == 1
    strict = {our_layout(spec_for(tp_size=tp, rank=r)).base_path
              for tp, r in [(1, 0), (2, 1), (4, 2)]}
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


# -- config.json ---------------------------------------------------------------------


@pytest.fixture
def vllm_builtin_fs(monkeypatch):
    """Our plugin may have taken over type "fs" in this process; these tests
    need vLLM's own implementation behind harness.builtin()."""
    monkeypatch.setitem(SecondaryTierFactory._registry, "fs", lambda: FileSystemTierManager)


def _builtin_is_vllms(replica: Replica) -> None:
    assert type(replica.tier) is FileSystemTierManager


@pytest.mark.parametrize("kw", [
    dict(),
    dict(model="meta-llama/Llama-3.1-8B-Instruct", tp_size=2, agnostic=True, groups=TWO_GROUPS),
    dict(model="acme/modèl-ü", dtype="float16", tp_size=4, rank=0, replicated_layout=True),
], ids=["default", "agnostic-two-groups", "unicode-replicated"])
def test_rendered_config_json_is_byte_identical_to_builtin(disk_root, kw, vllm_builtin_fs):
    replica = Replica(offloading_config(tiers=[builtin(disk_root)], **kw))
    try:
        _builtin_is_vllms(replica)
        layout = our_layout(replica.spec, disk_root)
        assert layout.config_path == replica.tier.file_mapper.get_config_file_path()
        with open(layout.config_path, "rb") as f:
            written_by_vllm = f.read()
        assert render_run_config(layout.run_config) == written_by_vllm
        # And our tier accepts vLLM's file as its own.
        assert ensure_run_config(layout) == "matched"
        with open(layout.config_path, "rb") as f:
            assert f.read() == written_by_vllm
    finally:
        replica.close()


def test_ensure_run_config_creates_then_matches(disk_root):
    spec = spec_for(model="meta-llama/Llama-3.1-8B-Instruct", groups=TWO_GROUPS)
    layout = our_layout(spec, disk_root)
    assert not os.path.exists(layout.base_path)
    assert ensure_run_config(layout) == "created"
    assert os.listdir(layout.base_path) == ["config.json"]
    with open(layout.config_path, "rb") as f:
        first = f.read()
    assert first == render_run_config(layout.run_config)
    assert json.loads(first) == vllm_mapper(spec, disk_root).get_run_config()
    assert ensure_run_config(layout) == "matched"
    assert os.listdir(layout.base_path) == ["config.json"]
    with open(layout.config_path, "rb") as f:
        assert f.read() == first


def test_ensure_run_config_writes_through_a_temp_name_and_rename(disk_root, monkeypatch):
    layout = our_layout(spec_for(), disk_root)
    wanted = render_run_config(layout.run_config)
    renames = []
    real_rename = os.rename

    def checking_rename(src, dst):
        src, dst = os.fspath(src), os.fspath(dst)
        if dst == layout.config_path:
            # At the moment of publication the final name does not exist yet
            # and the temp file already holds every byte.
            assert not os.path.exists(dst)
            with open(src, "rb") as f:
                assert f.read() == wanted
            assert os.path.dirname(src) == os.path.dirname(dst)
            parsed = parse_temp_name(os.path.basename(src))
            assert parsed is not None
            assert parsed.pid == os.getpid()
            renames.append(src)
        return real_rename(src, dst)

    monkeypatch.setattr(run_config_module.os, "rename", checking_rename)
    assert ensure_run_config(layout) == "created"
    assert len(renames) == 1
    assert not os.path.exists(renames[0])
    assert os.listdir(layout.base_path) == ["config.json"]


def test_two_writers_in_one_process_both_succeed(disk_root, monkeypatch):
    layout = our_layout(spec_for(), disk_root)
    real_rename = os.rename
    results = []

    def interleaving_rename(src, dst):
        # Deterministic interleaving: a second writer (another thread of the
        # same process) runs its whole ensure_run_config between our write
        # and our rename.
        if not results:
            results.append("inner-started")
            results.append(ensure_run_config(layout))
        return real_rename(src, dst)

    monkeypatch.setattr(run_config_module.os, "rename", interleaving_rename)
    outer = ensure_run_config(layout)
    assert results[1] in ("created", "matched")
    assert outer in ("created", "matched")
    with open(layout.config_path, "rb") as f:
        assert f.read() == render_run_config(layout.run_config)


def _other_run_config(layout: CacheLayout) -> dict:
    other = dict(layout.run_config)
    other["tokens_per_hash"] = layout.run_config["tokens_per_hash"] * 2
    return other


def test_mismatching_config_json_raises_and_is_left_untouched(disk_root):
    layout = our_layout(spec_for(), disk_root)
    os.makedirs(layout.base_path)
    foreign = json.dumps(_other_run_config(layout), indent=2, sort_keys=True).encode()
    with open(layout.config_path, "wb") as f:
        f.write(foreign)
    before = os.stat(layout.config_path)

    with pytest.raises(RunConfigMismatch) as info:
        ensure_run_config(layout)
    message = str(info.value)
    assert layout.config_path in message
    assert "tokens_per_hash" in message
    assert "model_name" not in message  # only the differing field is named

    after = os.stat(layout.config_path)
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == \
        (before.st_ino, before.st_mtime_ns, before.st_size)
    with open(layout.config_path, "rb") as f:
        assert f.read() == foreign
    assert os.listdir(layout.base_path) == ["config.json"]
    assert not os.path.exists(layout.rank_dir)


def test_mismatch_names_an_extra_field(disk_root):
    layout = our_layout(spec_for(), disk_root)
    os.makedirs(layout.base_path)
    other = dict(layout.run_config, replicated_layout=True)
    with open(layout.config_path, "w") as f:
        json.dump(other, f)
    with pytest.raises(RunConfigMismatch, match="replicated_layout"):
        ensure_run_config(layout)


@pytest.mark.parametrize("content", [b"null", b"42", b"[{\"a\": 1}]"])
def test_non_object_config_json_is_a_mismatch(disk_root, content):
    layout = our_layout(spec_for(), disk_root)
    os.makedirs(layout.base_path)
    with open(layout.config_path, "wb") as f:
        f.write(content)
    with pytest.raises(RunConfigMismatch, match="different run config"):
        ensure_run_config(layout)
    with open(layout.config_path, "rb") as f:
        assert f.read() == content


def test_unparsable_config_json_is_repaired_after_grace(disk_root):
    layout = our_layout(spec_for(), disk_root)
    os.makedirs(layout.base_path)
    with open(layout.config_path, "wb") as f:
        f.write(b"\xff\xfe{ half a json docu")
    assert ensure_run_config(layout) == "repaired"
    with open(layout.config_path, "rb") as f:
        assert f.read() == render_run_config(layout.run_config)
    assert os.listdir(layout.base_path) == ["config.json"]
    assert ensure_run_config(layout) == "matched"


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
@pytest.mark.parametrize("final", ["/mnt/kv/m_abc_r0/abc/de_g0/abcdef0123.bin",
                                   "/mnt/kv/m_abc/config.json"])
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


@pytest.mark.parametrize("name", [
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
])
def test_parse_temp_name_rejects_other_names(name):
    assert parse_temp_name(name) is None


# -- starting our tier on someone else's digest --------------------------------------


def test_our_tier_refuses_a_root_with_a_foreign_config_json(disk_root):
    engine_id = f"llmkvtest_{uuid.uuid4().hex[:12]}"
    cfg = offloading_config(tiers=[ours(disk_root)], engine_id=engine_id)
    layout = our_layout(spec_for(engine_id=engine_id), disk_root)
    os.makedirs(layout.base_path)
    foreign = json.dumps(_other_run_config(layout), indent=2, sort_keys=True).encode()
    with open(layout.config_path, "wb") as f:
        f.write(foreign)

    with pytest.raises(RunConfigMismatch, match="different run config") as info:
        Replica(cfg)
    assert layout.config_path in str(info.value)
    with open(layout.config_path, "rb") as f:
        assert f.read() == foreign
    assert glob.glob(f"{disk_root}/**/*.bin", recursive=True) == []
    assert not os.path.exists(layout.rank_dir)
    assert sorted(os.listdir(disk_root)) == [os.path.basename(layout.base_path)]
    assert glob.glob(f"/dev/shm/vllm_offload_{engine_id}.mmap*") == []


def test_our_tier_starts_on_a_matching_root(disk_root):
    """Control for the test above: the same setup with a matching file starts."""
    engine_id = f"llmkvtest_{uuid.uuid4().hex[:12]}"
    layout = our_layout(spec_for(engine_id=engine_id), disk_root)
    assert ensure_run_config(layout) == "created"
    replica = Replica(offloading_config(tiers=[ours(disk_root)], engine_id=engine_id))
    try:
        assert replica.tier.layout == layout
        assert os.path.isdir(layout.rank_dir)
    finally:
        replica.close()
