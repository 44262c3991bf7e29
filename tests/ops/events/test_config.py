"""``--kv-events-config`` is vLLM's JSON, checked before any pass: a bad
value is refused with an error naming its key (no vLLM needed)."""

import pytest

from llmkv_fs.cli import main as cli_main
from llmkv_fs.ops.events.config import EventsConfigError, parse_events_config


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
