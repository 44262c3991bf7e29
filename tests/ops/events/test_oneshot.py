"""The one-shot tools (``events snapshot``, ``verify --repair``, a gc
without ``--watch``) deliver what they announce to a router that subscribes
late: they wait for its subscription, never drop on a full queue and flush
on exit. The router is its own process decoding with vLLM's classes
(``tests/kits/subscriber_kit.py``), connecting only once the tool's bind is
observed, or behind a relay that delays every chunk by 50 ms. With no
subscriber at all the tool waits ``wait_s`` and exits 3, saying so."""

from __future__ import annotations

import json
import os

import pytest

from llmkv_fs.cli import main as cli_main
from llmkv_fs.ops.events.options import EXIT_UNDELIVERED
from tests.kits import gc_kit
from tests.kits.events_kit import volume_hashes
from tests.kits.subscriber_kit import DelayRelay, Subscriber
from tests.kits.volume_kit import flip_a_bit

DAY = 86400.0
WAIT_S = 120  # the tools' wait for the subscriber: bounds a hang only


def _blocks(root: str, n: int, seed: str, payload: int = 16, **kw) -> list[str]:
    layout = gc_kit.make_digest(root, **kw)[0]
    return [
        gc_kit.put_block(layout, gc_kit.key(i, seed), seconds_old=DAY, payload=payload)
        for i in range(n)
    ]


def _config(endpoint: str, **extra) -> str:
    return json.dumps({"endpoint": endpoint, "wait_s": WAIT_S, **extra})


def _index(result: dict) -> set:
    return set(result["index"])


@pytest.fixture
def ipc_dir(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    return path


def test_a_snapshot_reaches_a_router_that_connects_after_its_bind(disk_root, ipc_dir, capsys):
    _blocks(disk_root, 40, "late")
    sock = ipc_dir / "events.sock"
    router = Subscriber("--connect", f"ipc://{sock}", "--after", str(sock), "--expect", "40")
    try:
        status = cli_main(
            ["events", "snapshot", disk_root, "--kv-events-config", _config(f"ipc://{sock}")]
        )
        result = router.result()
    finally:
        router.close()
    assert status == 0, capsys.readouterr()
    assert result["seqs_ok"] and result["events"] == 40
    assert _index(result) == volume_hashes(disk_root)


@pytest.mark.integration  # ~20 s: a second process importing vLLM, and verify's reads
def test_verify_repair_reaches_a_router_that_connects_after_its_bind(disk_root, ipc_dir, capsys):
    paths = _blocks(disk_root, 3, "repair")
    flip_a_bit(paths[0], offset=3)
    sock = ipc_dir / "events.sock"
    router = Subscriber("--connect", f"ipc://{sock}", "--after", str(sock), "--expect", "1")
    try:
        status = cli_main(
            ["verify", disk_root, "--repair", "--kv-events-config", _config(f"ipc://{sock}")]
        )
        result = router.result()
    finally:
        router.close()
    assert status == 1, capsys.readouterr()  # a bad file was found (and moved aside)
    assert not os.path.exists(paths[0])
    assert result["seqs_ok"] and result["events"] == 1 and result["index"] == []


def test_a_one_pass_gc_reaches_a_router_that_connects_after_its_bind(disk_root, ipc_dir, capsys):
    _blocks(disk_root, 7, "gc")
    sock = ipc_dir / "events.sock"
    router = Subscriber("--connect", f"ipc://{sock}", "--after", str(sock), "--expect", "7")
    try:
        status, report = gc_kit.gc(
            disk_root,
            "--max-bytes",
            "0",
            "--protect",
            "0s",
            "--kv-events-config",
            _config(f"ipc://{sock}"),
            capsys=capsys,
        )
        result = router.result()
    finally:
        router.close()
    assert status == 0
    assert report["capacity"]["evicted_blocks"] == 7
    assert report["events"]["published"] == 7
    assert result["seqs_ok"] and result["events"] == 7
    assert volume_hashes(disk_root) == set()


@pytest.mark.integration  # ~30 s on 2 cores: 30,000 files and a process importing vLLM
def test_a_30000_block_snapshot_reaches_a_router_on_a_slow_link(disk_root, capsys):
    """Behind a relay that delays every chunk 50 ms: the subscription comes
    late, and the close must flush what ZMQ still holds."""
    _blocks(disk_root, 30_000, "slow")
    router = Subscriber("--bind", "--expect", "30000")
    relay = DelayRelay(router.port)
    try:
        status = cli_main(
            [
                "events",
                "snapshot",
                disk_root,
                "--rate",
                "10000000",
                "--json",
                "--kv-events-config",
                _config(f"tcp://127.0.0.1:{relay.port}"),
            ]
        )
        result = router.result()
    finally:
        relay.close()
        router.close()
    summary = json.loads(capsys.readouterr().out)
    assert status == 0
    assert summary["blocks"] == 30_000 and summary["events"]["published"] == 30_000
    assert result["seqs_ok"] and result["events"] == 30_000
    assert _index(result) == volume_hashes(disk_root)


@pytest.mark.parametrize("tool", ["snapshot", "gc"])
def test_no_subscriber_waits_wait_s_then_says_not_delivered(disk_root, ipc_dir, tool, capsys):
    """Nobody subscribes: the tool gives up after wait_s, still does its
    work (gc removes), and exits 3 naming the cause and the setting."""
    paths = _blocks(disk_root, 5, "nobody")
    config = json.dumps({"endpoint": f"ipc://{ipc_dir / 'none.sock'}", "wait_s": 0.2})
    if tool == "snapshot":
        status = cli_main(["events", "snapshot", disk_root, "--kv-events-config", config])
    else:
        status, _report = gc_kit.gc(
            disk_root, "--max-bytes", "0", "--protect", "0s", "--kv-events-config", config
        )
    err = capsys.readouterr().err
    assert status == EXIT_UNDELIVERED
    assert "5 of 5 not delivered" in err
    assert "0 of 1 subscribers within 0.2s (subscribers, wait_s)" in err
    if tool == "gc":
        assert not any(os.path.exists(p) for p in paths)


def test_it_waits_for_every_wanted_subscriber(disk_root, ipc_dir, capsys):
    """subscribers: 2: both routers get every event (two SUB sockets here,
    connecting before the bind: ZMQ retries until it exists)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    _blocks(disk_root, 4, "two")
    endpoint = f"ipc://{ipc_dir / 'events.sock'}"
    subs = [zmq.Context.instance().socket(zmq.SUB) for _ in range(2)]
    try:
        for sub in subs:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
        status = cli_main(
            [
                "events",
                "snapshot",
                disk_root,
                "--kv-events-config",
                _config(endpoint, subscribers=2),
            ]
        )
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        got = []
        for sub in subs:
            hashes = set()
            while len(hashes) < 4 and sub.poll(60_000):
                for event in decoder.decode(sub.recv_multipart()[2]).events:
                    hashes.update(event.block_hashes)
            got.append(hashes)
    finally:
        for sub in subs:
            sub.close(linger=0)
    assert status == 0, capsys.readouterr()
    assert got == [volume_hashes(disk_root)] * 2
