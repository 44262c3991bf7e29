"""``llmkv-fs doctor``: replicas started through vLLM's real offloading
stack (tests/kits/tier_kit.py) that differ in exactly one thing, and the
command names that thing and nothing else; the same replicas alike are
reported as sharing (exit 0). Then hostile volumes: the command reports
what it cannot read, never follows a link, never changes a byte.

The command reads config.json files and leases only; the replicas are
there to write them as the tier does, so the engine's I/O mode does not
matter here (tests/tier/ drives the tier in both)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import yaml

from llmkv_fs import cli
from llmkv_fs.layout.names import lease_dir
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.ops.doctor import diagnose
from llmkv_fs.volume.leases import seed_fingerprint
from llmkv_fs.volume.run_config import ensure_run_config
from tests.kits.seal_kit import key_file
from tests.kits.tier_kit import make_keys, ours, start, wait_until

LAYERS = ("layer.0", "layer.1")


def doctor(capsys, *args: str) -> tuple[int, dict]:
    status = cli.main(["doctor", *args, "--json"])
    return status, json.loads(capsys.readouterr().out)


def leased(replica, root: str) -> None:
    """Step ``replica`` until its lease is on ``root`` (the tier publishes it
    after its first step, from its housekeeping thread): a lease name that
    was not there before."""
    (engine_root,) = [r for r in replica.tier.engine.roots if r.root_dir == root]
    directory = lease_dir(engine_root.layout.base_path)

    def names() -> set[str]:
        try:
            return {n for n in os.listdir(directory) if n.endswith(".json") and n[0] != "."}
        except FileNotFoundError:
            return set()

    before = names()

    def written() -> bool:
        replica.step()
        return bool(names() - before)

    wait_until(written, "the replica's lease")


def sharing_replicas(replicas, root: str, first: dict, second: dict, **config):
    a = start(replicas, ours(root, **first.pop("tier", {})), **{**config, **first})
    leased(a, root)
    a.store(make_keys(2))
    b = start(replicas, ours(root, **second.pop("tier", {})), **{**config, **second})
    leased(b, root)
    return a, b


# One thing differs, as vLLM names it (offloading_config's keywords).
RUN_CONFIG_CASES = {
    "block_size": ({"groups": ((16, LAYERS),)}, {"groups": ((32, LAYERS),)}),
    "dtype": ({"dtype": "bfloat16"}, {"dtype": "float16"}),
    "kv_layout": ({"groups": ((16, LAYERS),)}, {"groups": ((16, (*LAYERS, "layer.2")),)}),
    "tensor_parallel_size": ({"tp_size": 1}, {"tp_size": 2}),
}


@pytest.mark.parametrize("field", sorted(RUN_CONFIG_CASES))
def test_replicas_differing_in_one_run_config_field_are_named(tmp_path, replicas, capsys, field):
    root = str(tmp_path / "v")
    first, second = RUN_CONFIG_CASES[field]
    sharing_replicas(replicas, root, dict(first), dict(second))
    status, report = doctor(capsys, root)
    assert status == 1
    assert len(report["deployments"]) == 2
    assert all(len(d["live"]) == 1 for d in report["deployments"])
    (finding,) = report["findings"]
    assert finding["kind"] == "run_config" and finding["stops_sharing"]
    assert finding["fields"] == [field]
    cli.main(["doctor", root])
    text = capsys.readouterr().out
    assert "DOES NOT SHARE: " in text and f"{field} " in text and "nothing can be shared" in text


def test_the_same_replicas_alike_share(tmp_path, replicas, capsys):
    root = str(tmp_path / "v")
    sharing_replicas(replicas, root, {}, {})
    status, report = doctor(capsys, root)
    assert status == 0, report["findings"]
    (dep,) = report["deployments"]
    assert len(dep["live"]) == 2 and report["findings"] == [] and report["sharing"]
    assert dep["holds_blocks"] and dep["walk"] is None
    status, walked = doctor(capsys, root, "--walk")
    assert status == 0 and walked["deployments"][0]["walk"]["blocks"] == 2
    cli.main(["doctor", root])
    assert "nothing stops these replicas from sharing" in capsys.readouterr().out


def test_a_replica_hashing_with_another_seed_is_named(tmp_path, replicas, capsys, monkeypatch):
    root = str(tmp_path / "v")
    a = start(replicas, ours(root))
    leased(a, root)
    # In one process both replicas share vLLM's NONE_HASH; the second one
    # announces what a replica started with another PYTHONHASHSEED would.
    other = ("sha256", seed_fingerprint("sha256", "another PYTHONHASHSEED"))
    monkeypatch.setattr("llmkv_fs.tier.fs_tier.hashing_identity", lambda: other)
    b = start(replicas, ours(root))
    leased(b, root)
    status, report = doctor(capsys, root)
    assert status == 1
    (finding,) = report["findings"]
    assert finding["kind"] == "hash_seed"
    assert (
        "different seeds" in finding["message"]
        and "replicas will not share cache" in finding["message"]
    )


def test_a_replica_sealing_with_a_key_the_other_lacks_is_named(tmp_path, replicas, capsys):
    root = str(tmp_path / "v")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    mine, theirs = key_file(secrets, "a"), key_file(secrets, "b")
    a = start(replicas, ours(root, seal_key_files={"1": mine}))
    leased(a, root)
    b = start(replicas, ours(root, seal_key_files={"1": theirs}))
    leased(b, root)
    status, report = doctor(capsys, root)
    assert status == 1
    assert {f["kind"] for f in report["findings"]} == {"sealing_key"}
    assert len(report["findings"]) == 2  # each misses the other's blocks
    assert "holds another key under that id" in report["findings"][0]["message"]
    for path in (mine, theirs):
        with open(path) as f:
            assert f.read().strip() not in json.dumps(report)


def test_replicas_placing_over_other_root_lists_are_named(tmp_path, replicas, capsys):
    shared, a_only, b_only = (str(tmp_path / n) for n in ("shared", "a", "b"))
    sharded = {"path_sharding": "by_block_hash"}
    a = start(replicas, ours(f"{shared},{a_only}", **sharded))
    leased(a, shared)
    b = start(replicas, ours(f"{shared},{b_only}", **sharded))
    leased(b, shared)
    status, report = doctor(capsys, shared)
    assert status == 1
    (finding,) = report["findings"]
    assert finding["kind"] == "root_list"


def test_against_a_replicas_own_config(tmp_path, replicas, capsys):
    root = str(tmp_path / "v")
    a = start(replicas, ours(root), groups=((16, LAYERS),))
    leased(a, root)
    config = tmp_path / "mine.json"
    run_config = dict(a.tier.engine.roots[0].layout.run_config)
    run_config["kv_cache_groups"] = [{"tokens_per_block": 32, "layer_names": list(LAYERS)}]
    config.write_text(json.dumps(run_config))
    status, report = doctor(capsys, root, "--against", str(config))
    assert status == 1
    (finding,) = report["findings"]
    assert finding["kind"] == "against" and finding["fields"] == ["block_size"]
    assert cli.main(["doctor", root, "--against", str(tmp_path / "missing.json")]) == 2
    assert "--against" in capsys.readouterr().err


def serve_settings(block_size: int, **more: str) -> dict:
    """vllm serve --config keys (dashes, as operators write them) of the
    replicas ``start`` makes: its model, dtype, ``block_size`` tokens per
    block and per offloaded chunk (one block per file)."""
    return {
        "model": "acme/llama-test",
        "dtype": "bfloat16",
        "block-size": block_size,
        "kv-transfer-config": {
            "kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {"block_size": block_size},
        },
        **more,
    }


def as_args(settings: dict) -> str:
    return " ".join(
        f"--{k} {json.dumps(v)!r}" if isinstance(v, dict) else f"--{k} {v}"
        for k, v in settings.items()
    )


def test_against_a_serve_config_file_and_serve_arguments(tmp_path, replicas, capsys):
    """A replica's own vLLM settings, as a --config YAML file and as the
    arguments an operator passes, against a deployment a real replica
    stored: the block size named when it differs, nothing when alike, and
    what the arguments cannot tell listed."""
    root = str(tmp_path / "v")
    a = start(replicas, ours(root), groups=((16, LAYERS),))
    leased(a, root)
    a.store(make_keys(2))
    other, alike = tmp_path / "other.yaml", tmp_path / "alike.yaml"
    other.write_text(yaml.safe_dump(serve_settings(32)))
    alike.write_text(yaml.safe_dump(serve_settings(16)))
    for option, value in (
        ("--against", str(other)),
        ("--against-args", "vllm serve " + as_args(serve_settings(32))),
    ):
        status, report = doctor(capsys, root, option, value)
        assert status == 1, report
        (finding,) = report["findings"]
        assert finding["kind"] == "against" and finding["stops_sharing"]
        # --block-size sets the blocks' tokens and, with one KV group, the hash's.
        assert finding["fields"] == ["block_size", "hash_block_size"]
        assert "block_size 32 vs 16: a prompt is cut into other blocks" in finding["message"]
        unjudged = {u["field"] for u in finding["unjudged"]}
        assert {"kv_layout", "sealing"} <= unjudged and "block_size" not in unjudged
    for option, value in (
        ("--against", str(alike)),
        ("--against-args", as_args(serve_settings(16))),
    ):
        status, report = doctor(capsys, root, option, value)
        assert status == 0 and report["findings"] == [], report["findings"]
        assert report["against"]["known"]["blocks_per_file"] == 1
    # What the arguments leave to the model is not judged, and said so.
    assert cli.main(["doctor", root, "--against-args", "--model acme/llama-test"]) == 0
    text = capsys.readouterr().out
    assert "--against-args cannot tell: dtype (--dtype auto" in text and "block_size" in text
    status, report = doctor(
        capsys,
        root,
        "--against-args",
        as_args(serve_settings(16, **{"prefix-caching-hash-algo": "xxhash"})),
    )
    assert status == 1 and report["findings"][0]["fields"] == ["prefix_caching_hash_algo"]


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("--against", "missing.yaml", "No such file"),
        ("--against", "list.yaml", "not a mapping"),
        ("--against", "fifo", "config.json, or a vllm serve --config file"),
        ("--against-args", "--model acme/llama-test --block-size sixteen", "--block-size"),
        ("--against-args", "--model acme/llama-test --dtype fp7", "is not one of auto"),
        ("--against-args", "--model 'acme/llama-test", "quotation"),
        ("--against-args", "--block-size 16", "no model"),
        ("--against-args", "--model acme/other --block-size 16", "no deployment of model"),
        (
            "--against-args",
            "--model acme/llama-test --block-size 16 --kv-transfer-config "
            '\'{"kv_connector_extra_config": {"block_size": 24}}\'',
            "not a multiple of --block-size 16",
        ),
    ],
)
def test_against_bad_input_is_refused_naming_the_option(
    tmp_path, replicas, capsys, option, value, says
):
    root = str(tmp_path / "v")
    a = start(replicas, ours(root))
    leased(a, root)
    (tmp_path / "list.yaml").write_text("- model\n- block-size\n")
    os.mkfifo(tmp_path / "fifo")
    if option == "--against":
        value = str(tmp_path / value)
    assert cli.main(["doctor", root, option, value]) == 2
    err = capsys.readouterr().err
    assert option in err and says in err, err


def test_sealed_blocks_under_a_key_no_live_replica_holds(tmp_path, replicas, capsys):
    """A replica sealed blocks with key id 1 and is gone; the live one holds
    only key id 2: --walk counts the blocks by the key in their trailers and
    says every live replica misses them, and what to do."""
    root = str(tmp_path / "v")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    old, new = key_file(secrets, "old"), key_file(secrets, "new")
    a = start(replicas, ours(root, seal_key_files={"1": old}))
    leased(a, root)
    a.store(make_keys(3))
    replicas.remove(a)
    a.close()  # its lease goes with it
    b = start(replicas, ours(root, seal_key_files={"2": new}))
    leased(b, root)
    b.store([make_keys(4)[3]])
    status, report = doctor(capsys, root)
    assert status == 0 and report["findings"] == []  # without --walk no block is read
    status, report = doctor(capsys, root, "--walk")
    (dep,) = report["deployments"]
    assert dep["sealed"] and len(dep["live"]) == 1 and dep["walk"]["blocks"] == 4
    assert sorted(n for n in dep["walk"]["sealed_with"].values()) == [1, 3]
    (finding,) = report["findings"]
    assert finding["kind"] == "unheld_key" and finding["key_id"] == 1
    assert finding["blocks"] == 3 and status == 0  # the live replicas share with each other
    assert "which no live replica holds: they are foreign_key misses" in finding["message"]
    assert "seal_key_files" in finding["message"] and "replaced" in finding["message"]
    status = cli.main(["doctor", root, "--walk"])
    out = capsys.readouterr().out
    assert status == 0 and "note: 3 blocks of " in out


# -- hostile volumes (no replica: files as anyone with write access makes them) --


def snapshot(root: str) -> dict[str, tuple]:
    """Every entry beneath ``root`` (links not followed): mode, size, mtime,
    content of regular files."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            data = None
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    data = f.read()
            seen[path] = (st.st_mode, st.st_size, st.st_mtime_ns, data)
    return seen


def test_a_hostile_volume_is_reported_never_followed_never_changed(tmp_path, capsys):
    root = tmp_path / "v"
    root.mkdir()
    outside = tmp_path / "outside"
    (outside / "leases").mkdir(parents=True)
    (outside / "config.json").write_text(json.dumps({"model_name": "x", "dtype": "fp8"}))
    # A digest directory that is a symlink out of the root; its rank dir too.
    os.symlink(outside, root / "m_0123456789ab")
    os.symlink(outside, root / "m_0123456789ab_r0")
    # A config.json that is not JSON, one that is a FIFO, one that is huge.
    for name, write in (
        ("m_111111111111", lambda p: p.write_bytes(b"\xff{not json")),
        ("m_222222222222", os.mkfifo),
        ("m_333333333333", lambda p: p.write_bytes(b" " * (2 << 20))),
    ):
        (root / name).mkdir()
        write(root / name / "config.json")
    # Leases: garbage, a symlink at a lease name, a leases dir that is a link.
    leases = root / "m_111111111111" / "leases"
    leases.mkdir()
    (leases / "h~1~1.json").write_text("[]")
    os.symlink("/etc/passwd", leases / "h~2~2.json")
    os.symlink(outside / "leases", root / "m_222222222222" / "leases")
    # Junk and a name that is not UTF-8.
    (root / "junk").mkdir()
    os.mkdir(os.fsencode(str(root)) + b"/m\xff_444444444444")
    before = snapshot(str(root))
    report = diagnose(str(root), walk=True, threads=2)
    assert snapshot(str(root)) == before
    names = {d["name"] for d in report["deployments"]}
    assert "m_0123456789ab" not in names  # a link is not a deployment of this root
    assert report["problems"]  # unreadable config.json files and leases, counted
    bad = {d["name"]: d for d in report["deployments"]}
    assert bad["m_111111111111"]["config"] is None
    assert [b["why"] for b in bad["m_111111111111"]["bad_leases"]]
    assert bad["m_222222222222"]["lease_error"]
    status = cli.main(["doctor", str(root), "--walk"])
    out = capsys.readouterr().out
    assert status == 0 and "config.json unreadable" in out
    assert cli.main(["doctor", str(tmp_path / "nope")]) == 2


def test_two_digests_of_one_model_on_a_large_volume_need_no_walk(tmp_path, capsys):
    """Two digests of one model written as the tier writes them: the field
    named, and without --walk nothing below the rank directories read."""
    root = tmp_path / "v"
    root.mkdir()
    base = {"model_name": "m", "dtype": "bfloat16", "tokens_per_hash": 16, "blocks_per_file": 1}
    for size in (16, 32):
        layout = CacheLayout(
            str(root),
            {**base, "kv_cache_groups": [{"tokens_per_block": size, "layer_names": ["l"]}]},
            0,
        )
        ensure_run_config(layout)
        os.makedirs(f"{layout.rank_dir}/000", exist_ok=True)
        for i in range(200):
            open(f"{layout.rank_dir}/000/{i:04x}", "w").close()
    report = diagnose(str(root))
    (finding,) = report["findings"]
    assert finding["fields"] == ["block_size"]
    assert all(d["holds_blocks"] and d["walk"] is None for d in report["deployments"])
