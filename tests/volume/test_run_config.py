"""config.json: byte-identical to vLLM's, written atomically, compared when
present; and what our tier does when a root holds someone else's run config.
"""

from __future__ import annotations

import glob
import json
import os
import uuid

import pytest
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from llmkv_fs.layout.names import parse_temp_name
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.volume import files as files_module  # run_config publishes through it
from llmkv_fs.volume.run_config import RunConfigMismatch, ensure_run_config, render_run_config
from tests.kits.layout_kit import TWO_GROUPS, our_layout, spec_for, vllm_mapper
from tests.kits.tier_kit import Replica, builtin, offloading_config, ours

# -- config.json ---------------------------------------------------------------------


@pytest.fixture
def vllm_builtin_fs(monkeypatch):
    """Our plugin may have taken over type "fs" in this process; these tests
    need vLLM's own implementation behind harness.builtin()."""
    monkeypatch.setitem(SecondaryTierFactory._registry, "fs", lambda: FileSystemTierManager)


def _builtin_is_vllms(replica: Replica) -> None:
    assert type(replica.tier) is FileSystemTierManager


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "tp_size": 2,
            "agnostic": True,
            "groups": TWO_GROUPS,
        },
        {
            "model": "acme/modèl-ü",
            "dtype": "float16",
            "tp_size": 4,
            "rank": 0,
            "replicated_layout": True,
        },
    ],
    ids=["default", "agnostic-two-groups", "unicode-replicated"],
)
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

    def checking_rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        if dst == "config.json":
            # Both names relative to the digest directory's descriptor (it is
            # resolved beneath the root); at the moment of publication the
            # final name does not exist yet and the temp file holds every byte.
            assert src_dir_fd is not None and src_dir_fd == dst_dir_fd
            assert os.readlink(f"/proc/self/fd/{dst_dir_fd}") == layout.base_path
            assert not os.path.exists(layout.config_path)
            with open(os.path.join(layout.base_path, src), "rb") as f:
                assert f.read() == wanted
            parsed = parse_temp_name(src)
            assert parsed is not None
            assert parsed.pid == os.getpid()
            renames.append(os.path.join(layout.base_path, src))
        return real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(files_module.os, "rename", checking_rename)
    assert ensure_run_config(layout) == "created"
    assert len(renames) == 1
    assert not os.path.exists(renames[0])
    assert os.listdir(layout.base_path) == ["config.json"]


def test_two_writers_in_one_process_both_succeed(disk_root, monkeypatch):
    layout = our_layout(spec_for(), disk_root)
    real_rename = os.rename
    results = []

    def interleaving_rename(src, dst, **dir_fds):
        # Deterministic interleaving: a second writer (another thread of the
        # same process) runs its whole ensure_run_config between our write
        # and our rename.
        if not results:
            results.append("inner-started")
            results.append(ensure_run_config(layout))
        return real_rename(src, dst, **dir_fds)

    monkeypatch.setattr(files_module.os, "rename", interleaving_rename)
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
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )
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


@pytest.mark.parametrize("content", [b"null", b"42", b'[{"a": 1}]'])
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
        assert replica.tier.engine.roots[0].layout == layout
        assert os.path.isdir(layout.rank_dir)
    finally:
        replica.close()
