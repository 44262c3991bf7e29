"""Announce block files leaving (or, for a snapshot, on) the volume in
vLLM's own KV events: ``BlockRemoved`` / ``BlockStored`` with medium
``STORAGE``, batched in a ``KVEventBatch`` and sent by vLLM's
``ZmqEventPublisher`` (multipart topic / 8-byte sequence / msgpack), one
publisher per configured target.

Identity: what vLLM 0.33's offloading connector publishes for a chunk of a
secondary tier (``OffloadingEventsTracker._placeholder_stored`` and its
removal twin, the default unless ``self_describing_kv_events`` is on): one
hash, the chunk's OffloadKey block hash -- exactly the file's name -- run
through ``maybe_convert_block_hash`` (the lower 64 bits as an integer
unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: give gc the replicas'
value), and ``group_idx`` the key's group. docs/deployment.md says what a
router sees with ``self_describing_kv_events`` and chunks of several GPU
blocks.

Long-running (gc ``--watch``): best-effort, never blocking: vLLM's
``publish`` waits on a full queue, so a batch is offered only while the
queue has room (this object is the queue's only producer: the check cannot
go stale into a wait) and otherwise dropped; a PUB socket drops on its own
past ``hwm`` and never waits for a subscriber; an exception while
publishing is counted and logged (once per kind every minute). ``counts``
says what was published, dropped and failed.

One-shot (``one_shot``: a tool that sends and exits): each target is a
``OneShotPublisher`` (``oneshot.py``), which waits for its subscribers,
never drops and flushes on close, each bounded by the target's ``wait_s``;
``flush`` then blocks for as long. What could not reach every wanted
subscriber counts as ``undelivered`` and ``troubles`` says why: the tool's
output and exit status tell.

Threading: one thread at a time calls ``removed``, ``stored``, ``flush``
and ``close`` (gc acts from one thread); vLLM's publisher threads send.
vLLM is imported when the first Announcer is built, never at module import
(``tests/test_rooms.py``).
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from llmkv_fs.ops.events.config import EventsTarget

if TYPE_CHECKING:
    from llmkv_fs.ops.events.oneshot import OneShotPublisher

__all__ = ["Announcer", "EventsUnavailable"]

logger = logging.getLogger("llmkv_fs.ops.events")

BATCH_EVENTS = 512  # hashes per published batch: ~6 KB of msgpack
_LOG_INTERVAL_S = 60.0


class EventsUnavailable(RuntimeError):
    """KV events were asked for where vLLM cannot be imported."""


@functools.cache
def _vllm() -> Any:
    try:
        import msgspec
        from vllm.distributed import kv_events
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
        from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx
    except ImportError as exc:
        raise EventsUnavailable(
            "KV events need vLLM (its ZmqEventPublisher and event classes, so the "
            f"wire format is vLLM's own): install vllm here, or leave events off ({exc})"
        ) from exc

    class Vllm:
        events = kv_events
        convert = staticmethod(maybe_convert_block_hash)
        block_hash = staticmethod(get_offload_block_hash)
        group_idx = staticmethod(get_offload_group_idx)
        # What vLLM's publisher encodes a batch with.
        msgpack_encoder = staticmethod(msgspec.msgpack.Encoder)

    return Vllm


class Announcer:
    def __init__(
        self,
        targets: Sequence[EventsTarget],
        locality: str | None = None,
        batch_events: int = BATCH_EVENTS,
        clock: Callable[[], float] = time.time,
        one_shot: bool = False,
    ):
        self._v = _vllm()
        self._locality = locality
        self.batch_events = batch_events
        self._clock = clock
        self.counts: collections.Counter[str] = collections.Counter()
        self._last_logged: dict[str, float] = {}
        self._removed: dict[int, list[Any]] = {}
        self._stored: list[Any] = []
        self._pending = 0
        self._publishers: list[Any] = []
        self._one_shot: list[OneShotPublisher] = []
        self._start_troubles: list[str] = []
        for target in targets:
            try:
                if one_shot:
                    self._one_shot.append(self._one_shot_publisher(target))
                    continue
                publisher = self._v.events.ZmqEventPublisher(0, **target.publisher_kwargs())
            except Exception as exc:  # a bind that fails, a host ZMQ refuses, ...
                self._failed("start", f"{target.endpoint}: {exc!r}")
                self._start_troubles.append(f"{target.endpoint}: could not start: {exc}")
                continue
            self._publishers.append(publisher)

    def _one_shot_publisher(self, target: EventsTarget) -> OneShotPublisher:
        from llmkv_fs.ops.events.oneshot import OneShotPublisher

        zmq_publisher = self._v.events.ZmqEventPublisher
        encoder = self._v.msgpack_encoder()
        return OneShotPublisher(
            target, encoder.encode, zmq_publisher._bind, zmq_publisher._is_bind_endpoint
        )

    # -- what to announce ---------------------------------------------------------

    def removed(self, key: bytes) -> None:
        """Queue a BlockRemoved for ``key``'s file (sent by ``flush`` or when
        a batch is full)."""
        v = self._v
        self._removed.setdefault(v.group_idx(key), []).append(v.convert(v.block_hash(key)))
        self._added()

    def stored(self, key: bytes) -> None:
        """Queue a BlockStored for ``key``'s file: one event per block, as
        vLLM's connector sends for a tier's chunk (several hashes in one
        BlockStored would claim a parent chain)."""
        v = self._v
        self._stored.append(
            v.events.BlockStored(
                block_hashes=[v.convert(v.block_hash(key))],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=v.events.MEDIUM_STORAGE,
                lora_name=None,
                group_idx=v.group_idx(key),
                locality=self._locality,
            )
        )
        self._added()

    def _added(self) -> None:
        self._pending += 1
        if self._pending >= self.batch_events:
            self.flush()

    def flush(self) -> int:
        """Publish what is queued; how many blocks it named."""
        if not self._pending:
            return 0
        events = self._v.events
        batch: list[Any] = [
            events.BlockRemoved(
                block_hashes=hashes,
                medium=events.MEDIUM_STORAGE,
                group_idx=group,
                locality=self._locality,
            )
            for group, hashes in self._removed.items()
        ]
        batch.extend(self._stored)
        n, self._pending = self._pending, 0
        self._removed, self._stored = {}, []
        for publisher in self._publishers:
            self._offer(publisher, events.KVEventBatch(ts=self._clock(), events=batch), n)
        for one_shot in self._one_shot:
            self._send(one_shot, events.KVEventBatch(ts=self._clock(), events=batch), n)
        if not self._publishers and not self._one_shot:
            self.counts["undelivered" if self._start_troubles else "dropped"] += n
        return n

    def _send(self, publisher: OneShotPublisher, batch: Any, n: int) -> None:
        batch.data_parallel_rank = 0  # as vLLM's publisher stamps it
        try:
            delivered = publisher.send(batch)
        except Exception as exc:
            self.counts["undelivered"] += n
            self._failed("publish", repr(exc))
            publisher.trouble = publisher.trouble or f"failed: {exc!r}"
            return
        self.counts["published" if delivered else "undelivered"] += n
        self.counts["batches"] += 1 if delivered else 0

    def _offer(self, publisher: Any, batch: Any, n: int) -> None:
        try:
            # publish() waits while the queue is full; never wait.
            if publisher._event_queue.full():
                self.counts["dropped"] += n
                self._failed("queue full", f"{n} events dropped")
                return
            publisher.publish(batch)
        except Exception as exc:
            self.counts["errors"] += n
            self._failed("publish", repr(exc))
            return
        self.counts["published"] += n
        self.counts["batches"] += 1

    def _failed(self, kind: str, detail: str) -> None:
        self.counts[f"failures: {kind}"] += 1
        now = time.monotonic()
        if now - self._last_logged.get(kind, -_LOG_INTERVAL_S) >= _LOG_INTERVAL_S:
            self._last_logged[kind] = now
            logger.warning("llmkv_fs: KV events %s: %s (best effort: carrying on)", kind, detail)

    @property
    def pending(self) -> int:
        """Blocks queued and not yet published."""
        return self._pending

    def troubles(self) -> list[str]:
        """One-shot: why events did not reach every wanted subscriber, one
        line per target in trouble (complete after ``close``)."""
        found = list(self._start_troubles)
        for publisher in self._one_shot:
            if publisher.trouble:
                found.append(f"{publisher.endpoint}: {publisher.trouble}")
            if not publisher.flushed:
                found.append(
                    f"{publisher.endpoint}: the flush on exit ran out of time (wait_s): "
                    "the last events may not have arrived"
                )
        return found

    def report(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def close(self) -> None:
        """Send what is queued and stop the publishers (vLLM's shutdown
        gives its queue a second, then drops the rest; a one-shot publisher
        flushes for up to its ``wait_s``)."""
        self.flush()
        publishers, self._publishers = self._publishers, []
        for publisher in publishers:
            try:
                publisher.shutdown()
            except Exception as exc:
                self._failed("shutdown", repr(exc))
        for one_shot in self._one_shot:
            if one_shot.closed:
                continue
            try:
                one_shot.close()
            except Exception as exc:
                self._failed("shutdown", repr(exc))
                one_shot.flushed = False

    def __enter__(self) -> Announcer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
