"""The publisher of a one-shot tool (``events snapshot``, ``verify
--repair``, a gc without ``--watch``): it waits for its subscribers before
the first event, never drops one on a full queue, and flushes on exit.

vLLM's ``ZmqEventPublisher`` cannot do that: its PUB socket never tells
who subscribed, so what it sends before a subscription has arrived is lost
(ZMQ's "slow joiner": a router across a network misses every event of a short
run), it drops silently past its high-water mark, and its shutdown closes
the socket without linger (what ZMQ still held is lost) -- harmless for an
engine that runs for days, fatal for a tool that sends once and exits,
where a router's replay request cannot reach a process that is gone. So
this is the XPUB variant, with vLLM's wire format unchanged: multipart
(topic, 8-byte big-endian sequence from 0, msgpack of the ``KVEventBatch``
encoded by msgspec, ``data_parallel_rank`` 0) on an endpoint bound or
connected by vLLM's rule.

* **Wait.** Before the first send it waits up to ``wait_s`` for
  ``subscribers`` subscriptions that match its topic (XPUB hands each
  subscription over as a message; ``XPUB_VERBOSE``: every subscriber's, not
  only the first of a prefix). Fewer in time: it sends to those there are,
  and every event counts as undelivered (with none, nothing is sent).
* **No drop.** ``XPUB_NODROP``: a send to a subscriber whose queue is full
  (``hwm`` batches) waits up to ``wait_s``, then the publisher gives up: that
  batch and every later one count as undelivered, so a stalled router costs
  one ``wait_s``, not one per batch.
* **Flush.** ``close`` lingers up to ``wait_s`` while ZMQ hands what it
  holds to the kernel (its own context: terminating it waits for exactly
  that); running out of time is reported (``flushed`` False).

A tool's run can so stall at most three times ``wait_s`` for its events.
``replay_endpoint`` is not served: nothing is dropped, and a router cannot
ask a process that has exited.

Threading: one thread uses an instance (gc and the tools publish from
one); ``send`` blocks, bounded as above.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from llmkv_fs.ops.events.config import EventsTarget

__all__ = ["OneShotPublisher"]

_SUBSCRIBE = 1  # first byte of an XPUB subscription message


class OneShotPublisher:
    def __init__(
        self,
        target: EventsTarget,
        encode: Callable[[Any], bytes],
        bind: Callable[[Any, str], str],
        is_bind: Callable[[str], bool],
        clock: Callable[[], float] = time.monotonic,
    ):
        """``encode``: a batch to its payload; ``bind`` / ``is_bind``: vLLM's
        rule for binding an endpoint (its publisher's own helpers)."""
        self.endpoint = target.endpoint
        self._topic = target.topic.encode("utf-8")
        self._wanted = target.subscribers
        self._wait_s = target.wait_s
        self._encode = encode
        self._clock = clock
        self._seq = 0
        self.subscribed = 0  # matching subscriptions seen
        self.waited = False
        self._gave_up = False
        # Why events do not reach every wanted subscriber; "" while they do.
        self.trouble = ""
        self.flushed = True
        self.closed = False
        self._ctx = zmq.Context()
        try:
            self._sock = self._ctx.socket(zmq.XPUB)
            self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._sock.setsockopt(zmq.XPUB_NODROP, 1)
            self._sock.setsockopt(zmq.SNDHWM, target.hwm)
            self._sock.setsockopt(zmq.SNDTIMEO, int(self._wait_s * 1000))
            self._sock.setsockopt(zmq.LINGER, 0)  # until close sets the flush's
            if is_bind(target.endpoint):
                self.endpoint = bind(self._sock, target.endpoint)
            else:
                self._sock.connect(target.endpoint)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

    def send(self, batch: Any) -> bool:
        """Send one batch; whether every wanted subscriber can get it
        (False: counted undelivered; ``trouble`` says why)."""
        if not self.waited:
            self._wait_for_subscribers()
        if self.subscribed == 0 or self._gave_up:
            return False
        try:
            self._sock.send_multipart(
                (self._topic, self._seq.to_bytes(8, "big"), self._encode(batch))
            )
        except zmq.Again:
            self._gave_up = True
            self.trouble = (
                f"gave up: a subscriber took no event for {self._wait_s:g}s "
                "(its queue full: wait_s)"
            )
            return False
        self._seq += 1
        return self.subscribed >= self._wanted

    def _wait_for_subscribers(self) -> None:
        self.waited = True
        deadline = self._clock() + self._wait_s
        while self.subscribed < self._wanted:
            left_ms = int(max(0.0, deadline - self._clock()) * 1000)
            if not self._sock.poll(left_ms, zmq.POLLIN):
                break
            message = self._sock.recv()
            if message[:1] == bytes([_SUBSCRIBE]) and self._topic.startswith(message[1:]):
                self.subscribed += 1
        if self.subscribed < self._wanted:
            self.trouble = (
                f"{self.subscribed} of {self._wanted} subscribers within {self._wait_s:g}s "
                "(subscribers, wait_s)"
            )

    def close(self) -> None:
        """Flush (at most ``wait_s``), then free the socket."""
        self.closed = True
        started = self._clock()
        self._sock.close(linger=int(self._wait_s * 1000))
        self._ctx.term()  # returns once ZMQ handed everything on, or at the linger
        # Terminating early proves the flush; one that took the whole linger may
        # have been cut short.
        if self._seq and self._clock() - started >= self._wait_s:
            self.flushed = False
