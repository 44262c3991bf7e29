"""``--kv-events-config`` is vLLM's JSON, checked before any pass: a bad
value is refused with an error naming its key (no vLLM needed)."""

import json
import os
import pathlib
import socket

import pytest

from llmkv_fs.cli import main as cli_main
from llmkv_fs.ops.events.config import EventsConfigError, parse_events_config
from llmkv_fs.ops.events.options import EXIT_UNDELIVERED
from tests.kits import gc_kit

DAY = 86400.0


@pytest.mark.parametrize(
    "given",
    [
        '{"endpoint": "tcp://indexer:5557"}',
        '{"endpoint": "tcp://*:5557", "topic": "kv@shared@acme/llama"}',
        '{"endpoint": "tcp://[::1]:5557"}',
        '{"endpoint": "ipc:///run/kv.sock", "enable_kv_cache_events": true, "publisher": "zmq"}',
        '{"endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": "tcp://*:5558", "hwm": 10}',
    ],
)
def test_what_vllm_accepts_is_accepted(given):
    target = parse_events_config(given)
    assert target.endpoint.split("://")[0] in ("tcp", "ipc")


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ('{"endpoint": "indexer:5557"}', "endpoint"),
        ('{"endpoint": "tcp://indexer"}', "endpoint"),
        ('{"endpoint": "tcp://indexer:99999"}', "endpoint"),
        ('{"endpoint": "tcp://in dexer:5557"}', "endpoint"),
        ('{"endpoint": "tcp://indexer:0"}', "endpoint"),
        ('{"endpoint": "tcp://[nope]:5557"}', "endpoint"),
        ('{"endpoint": 5557}', "endpoint"),
        ('{"endpoint": "ipc://"}', "endpoint"),
        ('{"topic": "kv"}', "endpoint is required"),
        ('{"endpoint": "tcp://h:1", "topic": 7}', "topic"),
        ('{"endpoint": "tcp://h:1", "topic": "a\\u0000b"}', "topic"),
        ('{"endpoint": "tcp://h:1", "hwm": 0}', "hwm"),
        ('{"endpoint": "tcp://h:1", "max_queue_size": true}', "max_queue_size"),
        ('{"endpoint": "tcp://h:1", "publisher": "null"}', "publisher"),
        ('{"endpoint": "tcp://h:1", "enable_kv_cache_events": false}', "enable_kv_cache_events"),
        ('{"endpoint": "tcp://h:1", "replay_endpoint": "tcp://h:2"}', "replay_endpoint"),
        ('{"endpoint": "tcp://h:1", "topik": "kv"}', "topik"),
        ('{"endpoint": "tcp://h:1", "wait_s": -1}', "wait_s"),
        ('{"endpoint": "tcp://h:1", "wait_s": "10"}', "wait_s"),
        ('{"endpoint": "tcp://h:1", "subscribers": 1001}', "subscribers"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(given, named):
    with pytest.raises(EventsConfigError, match=named):
        parse_events_config(given)


def test_gc_refuses_a_bad_endpoint_before_touching_the_volume(tmp_path, capsys):
    (tmp_path / "keep").write_text("x")
    with pytest.raises(SystemExit) as info:
        cli_main(["gc", str(tmp_path), "--kv-events-config", '{"endpoint": "tcp://nohost"}'])
    assert info.value.code == 2
    assert "endpoint='tcp://nohost'" in capsys.readouterr().err
    assert (tmp_path / "keep").exists()


# -- an ipc:// endpoint never destroys what is at its path ------------------------


def _gc_with_endpoint(root, endpoint, *more):
    return cli_main(
        [
            "gc",
            str(root),
            "--max-bytes",
            "0",
            "--protect",
            "0s",
            "--pid-check",
            "on",
            *more,
            "--kv-events-config",
            json.dumps({"endpoint": endpoint, "wait_s": 0}),
        ]
    )


def test_a_dry_run_binds_nothing_not_even_over_an_operators_file(disk_root, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.write_bytes(b"the operator's notes\n")
    block = gc_kit.put_block(gc_kit.make_digest(disk_root)[0], gc_kit.key(0), seconds_old=DAY)
    free = tmp_path / "free.sock"
    for endpoint in (f"ipc://{notes}", f"ipc://{block}", f"ipc://{free}"):
        assert _gc_with_endpoint(disk_root, endpoint, "--dry-run") == 0
        assert "--dry-run: no KV events are published" in capsys.readouterr().err
    assert notes.read_bytes() == b"the operator's notes\n"
    assert os.path.exists(block) and not free.exists()


@pytest.mark.parametrize("tool", ["gc", "verify", "snapshot"])
@pytest.mark.parametrize("what", ["regular file", "symlink", "block file", "inside the root"])
def test_an_ipc_endpoint_over_something_not_ours_is_refused(
    disk_root, tmp_path, capsys, what, tool
):
    notes = tmp_path / "notes"
    notes.write_bytes(b"the operator's notes\n")
    block = gc_kit.put_block(gc_kit.make_digest(disk_root)[0], gc_kit.key(0), seconds_old=DAY)
    before = pathlib.Path(block).read_bytes()
    target = {
        "regular file": str(notes),
        "symlink": str(tmp_path / "link"),
        "block file": block,
        "inside the root": os.path.join(disk_root, "events.sock"),
    }[what]
    if what == "symlink":
        os.symlink(notes, target)
    endpoint = f"ipc://{target}"
    if tool == "gc":
        with pytest.raises(SystemExit) as info:
            _gc_with_endpoint(disk_root, endpoint)
        status = info.value.code
    else:
        argv = (
            ["verify", disk_root, "--repair"]
            if tool == "verify"
            else ["events", "snapshot", disk_root]
        )
        with pytest.raises(SystemExit) as info:
            cli_main([*argv, "--kv-events-config", json.dumps({"endpoint": endpoint})])
        status = info.value.code
    err = capsys.readouterr().err
    assert status == 2
    assert "endpoint=" in err and "a path the tool may replace" in err
    assert notes.read_bytes() == b"the operator's notes\n"
    assert pathlib.Path(block).read_bytes() == before
    assert not os.path.exists(os.path.join(disk_root, "events.sock"))
    if what == "symlink":
        assert os.path.islink(target)


def test_an_ipc_endpoint_in_a_missing_directory_is_refused(disk_root, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _gc_with_endpoint(disk_root, f"ipc://{tmp_path / 'nowhere' / 'events.sock'}")
    assert info.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()


def test_a_listening_socket_is_refused_a_stale_one_replaced(disk_root, tmp_path, capsys):
    path = str(tmp_path / "events.sock")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen()
    try:
        with pytest.raises(SystemExit) as info:
            _gc_with_endpoint(disk_root, f"ipc://{path}")
        assert info.value.code == 2
        assert "another process is listening" in capsys.readouterr().err
    finally:
        listening.close()
    # Nobody listens now: a stale socket, ours to replace (no subscriber: exit 3).
    gc_kit.put_block(gc_kit.make_digest(disk_root)[0], gc_kit.key(0), seconds_old=DAY)
    assert _gc_with_endpoint(disk_root, f"ipc://{path}") == EXIT_UNDELIVERED
