"""A KV-aware router as its own process, for the one-shot tools' tests: a
real ZMQ SUB socket decoding vLLM's wire format with vLLM's own msgspec
classes, started before the tool and connecting (or accepting) on the
test's cue, so the test holds the order still:

* ``--connect ENDPOINT --after PATH``: connect only once PATH exists (the
  tool's ``ipc://`` bind observed: the tool is running and waiting);
* ``--bind``: bind a TCP port on 127.0.0.1, print ``port N`` (the tool, or a
  relay in front of it, connects).

It reads until ``--expect`` STORAGE hashes arrived (or DEADLINE_S passed),
then prints one JSON line: the index (stored minus removed), the counts,
and whether the sequence numbers ran from 0 without a gap.

Plus ``DelayRelay``: a TCP relay that forwards each chunk ~50 ms late in
both directions, a router on a slow link (this kernel has no netem).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

DEADLINE_S = 120.0  # bounds a hang only
READY_S = 120.0  # the subprocess's start (it imports vLLM)
SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connect")
    parser.add_argument("--after")
    parser.add_argument("--bind", action="store_true")
    parser.add_argument("--expect", type=int, required=True)
    args = parser.parse_args()

    import msgspec
    import zmq
    from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored, KVEventBatch

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if args.bind:
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        print(f"port {port}", flush=True)
    else:
        print("ready", flush=True)
        deadline = time.monotonic() + DEADLINE_S
        while not os.path.exists(args.after) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling for the tool's bind, under a deadline
        sub.connect(args.connect)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    stored: set = set()
    removed: set = set()
    seen = batches = 0
    seqs_ok = True
    deadline = time.monotonic() + DEADLINE_S
    while seen < args.expect and time.monotonic() < deadline:
        if not sub.poll(100):
            continue
        _topic, seq_bytes, payload = sub.recv_multipart()
        seqs_ok = seqs_ok and int.from_bytes(seq_bytes, "big") == batches
        batches += 1
        for event in decoder.decode(payload).events:
            if getattr(event, "medium", None) != MEDIUM_STORAGE:
                continue
            seen += len(event.block_hashes)
            if isinstance(event, BlockStored):
                stored.update(event.block_hashes)
                removed.difference_update(event.block_hashes)
            else:
                removed.update(event.block_hashes)
                stored.difference_update(event.block_hashes)
    index = sorted(h if isinstance(h, int) else h.hex() for h in stored)
    print(json.dumps({"index": index, "events": seen, "batches": batches, "seqs_ok": seqs_ok}))
    sub.close(linger=0)


class Subscriber:
    """The router process; ``result()`` its JSON line."""

    def __init__(self, *args: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kits.subscriber_kit", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=SRC,
        )
        assert self.proc.stdout is not None
        self.first_line = self.proc.stdout.readline().strip()  # "ready" or "port N"
        assert self.first_line, "the subscriber process did not start"

    @property
    def port(self) -> int:
        return int(self.first_line.split()[1])

    def result(self) -> dict:
        out, _ = self.proc.communicate(timeout=DEADLINE_S + READY_S)
        return json.loads(out.strip().splitlines()[-1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class DelayRelay:
    """Listens on 127.0.0.1; each connection is relayed to ``upstream``,
    every chunk in either direction forwarded ``delay_s`` after it was read
    (a slow link: the subscription reaches the publisher late)."""

    def __init__(self, upstream_port: int, delay_s: float = 0.05):
        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                time.sleep(self.delay_s)  # the link's latency, not synchronization
                sink.sendall(chunk)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        for s in self.sockets:
            s.close()


if __name__ == "__main__":
    main()
