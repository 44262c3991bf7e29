"""A KV-aware router's view, for the events tests: a real ZMQ SUB socket
(bound, as llm-d's indexer binds; publishers connect) decoding vLLM's wire
format with vLLM's own msgspec classes, keeping an index of the block
hashes on the STORAGE medium. Plus the volume's truth to compare it with.

No sleeps: a publisher is known connected once a probe batch (an empty
KVEventBatch, ts -1) came through, and a stream is read up to a marker
batch (ts -2) sent after everything else on the same socket (TCP keeps the
order); the sequence numbers in between must have no gap.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import Medium, OffloadingKVEventsConfig

from llmkv_fs.layout.names import parse_block_rel_path, parse_rank_dir_name
from llmkv_fs.ops.gc.lock import VolumeLock
from llmkv_fs.ops.gc.rules import Policy
from llmkv_fs.ops.gc.sweep import gc_pass

PROBE_TS, MARKER_TS = -1.0, -2.0
DEADLINE_S = 60.0  # bounds a hang only


class Router:
    """The subscriber and its index. ``drop_removals`` makes a router that
    ignores BlockRemoved (the variant that must fail)."""

    def __init__(self, drop_removals: bool = False):
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = f"tcp://127.0.0.1:{self.sub.bind_to_random_port('tcp://127.0.0.1')}"
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.index: set[Any] = set()
        # Every STORAGE hash ever announced stored / removed (drop_removals or not).
        self.stored: set[Any] = set()
        self.removed: set[Any] = set()
        self.drop_removals = drop_removals
        self.last_seq: dict[bytes, int] = {}
        self.topics: set[bytes] = set()
        self.batches = 0  # received

    def connect(self, publisher: ZmqEventPublisher) -> None:
        """Wait until ``publisher`` (connected to us) reaches us."""
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=PROBE_TS, events=[]))
            if self._receive(until=PROBE_TS, timeout_ms=100):
                return
        raise AssertionError("the publisher never reached the subscriber")

    def read_all(self, publisher: ZmqEventPublisher) -> None:
        """Everything ``publisher`` queued, applied to the index."""
        publisher._event_queue.join()  # its thread sent everything queued
        publisher.publish(KVEventBatch(ts=MARKER_TS, events=[]))
        assert self._receive(until=MARKER_TS, timeout_ms=int(DEADLINE_S * 1000)), "no marker"

    def drain(self, timeout_ms: int = 100) -> bool:
        """Apply what arrives until nothing has for ``timeout_ms``; whether
        anything did (a publisher this test cannot probe: a server's)."""
        batches = self.batches
        self._receive(until=PROBE_TS, timeout_ms=timeout_ms)
        return self.batches != batches

    def _receive(self, until: float, timeout_ms: int) -> bool:
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            last = self.last_seq.get(topic)
            assert last is None or seq == last + 1, f"gap in {topic!r}: {last} -> {seq}"
            self.last_seq[topic] = seq
            self.batches += 1
            batch = self.decoder.decode(payload)
            self.topics.add(topic)
            self.apply(batch)
            if batch.ts == until:
                return True
        return False

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if getattr(event, "medium", None) != MEDIUM_STORAGE:
                continue
            if isinstance(event, BlockStored):
                self.stored.update(event.block_hashes)
                self.index.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.removed.update(event.block_hashes)
                if not self.drop_removals:
                    self.index.difference_update(event.block_hashes)

    def close(self) -> None:
        self.sub.close(linger=0)


def replica_publisher(router: Router, name: str) -> ZmqEventPublisher:
    """A replica's own vLLM publisher, as ``--kv-events-config`` makes it."""
    publisher = ZmqEventPublisher(0, endpoint=router.endpoint, topic=f"kv@{name}@acme/llama-test")
    router.connect(publisher)
    return publisher


def pump(replica, publisher: ZmqEventPublisher, router: Router) -> list:
    """Turn the replica's OffloadingEvents into vLLM's KV events the way its
    connector does (OffloadingEventsTracker, default mode), publish them,
    and let the router read them."""
    with replica.manager.lock:
        events = list(replica.manager.take_events())
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
    kv_events = list(tracker.take_events(e for e in events if e.medium is Medium.STORAGE))
    if kv_events:
        publisher.publish(KVEventBatch(ts=time.time(), events=kv_events))
    router.read_all(publisher)
    return kv_events


def volume_hashes(*roots: str) -> set[Any]:
    """The hash a router should hold for every block file on the volume
    (independent of the product's walk: os.walk over rank directories)."""
    found = set()
    for root in roots:
        for name in os.listdir(root):
            if parse_rank_dir_name(name) is None:
                continue
            rank_dir = os.path.join(root, name)
            for here, dirs, files in os.walk(rank_dir):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                for file in files:
                    rel = os.path.relpath(os.path.join(here, file), rank_dir)
                    key = parse_block_rel_path(rel)
                    if key is not None:
                        found.add(maybe_convert_block_hash(key[:-4]))
    return found


def connect_announcer(router: Router, announce) -> None:
    """gc's publishers (connected to the router) reach it."""
    for publisher in announce._publishers:
        router.connect(publisher)


def read_announcer(router: Router, announce) -> None:
    announce.flush()
    for publisher in announce._publishers:
        router.read_all(publisher)


def gc_announcing(root: str, announce, **policy):
    """One gc pass over ``root`` announcing through ``announce``: nothing is
    protected by age; ``policy`` sets the limits (max_bytes=0 evicts all)."""
    values = {"min_age": 7 * 86400.0, "tmp_age": 3600, "protect": 0.0, "max_bytes": None}
    values.update({"high": None, "low": None, **policy})
    lock = VolumeLock(root)
    assert lock.acquire(wait=False)
    try:
        return gc_pass(root, Policy(pid_check=True, **values), lock, threads=1, announce=announce)
    finally:
        lock.release()
