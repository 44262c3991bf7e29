"""gc's cost of KV events: one capacity pass evicting every block of a
volume of tiny block files, with events off and on (a ZMQ subscriber in
another process reads them, as a router's indexer does: the sends really
happen, and its reading is not charged to gc's interpreter). Prints one
JSON line per run. ``python -m tools.bench.gc_events --blocks 100000``."""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time

import zmq

from llmkv_fs.layout.paths import CacheLayout, RunIdentity
from llmkv_fs.ops.events.announcer import Announcer
from llmkv_fs.ops.events.config import parse_events_config
from llmkv_fs.ops.gc.lock import VolumeLock
from llmkv_fs.ops.gc.rules import Policy
from llmkv_fs.ops.gc.sweep import gc_pass
from llmkv_fs.volume.run_config import ensure_run_config

IDENTITY = RunIdentity("acme/llama", "bfloat16", 16, 1, ((16, ("layer.0",)),))


def fill(root: str, blocks: int) -> None:
    layout = CacheLayout.for_identity(root, IDENTITY)
    ensure_run_config(layout)
    old = time.time() - 86400
    for i in range(blocks):
        key = hashlib.sha256(str(i).encode()).digest() + b"\0\0\0\0"
        path = layout.block_path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"x")
        os.utime(path, (old, old))


def one_pass(root: str, announce: Announcer | None) -> dict:
    policy = Policy(7 * 86400, 3600, 0.0, 0, None, None, True)
    lock = VolumeLock(root)
    assert lock.acquire(wait=False)
    try:
        report = gc_pass(root, policy, lock, threads=1, announce=announce)
    finally:
        lock.release()
    return {"seconds": report.seconds, "evicted": report.capacity["evicted_blocks"]}


def subscriber(conn) -> None:
    """The router's side, in its own process: binds, sends its endpoint,
    counts batches; on "count" (asked once nothing came for 100 ms) sends
    the count since the last one, on "stop" returns."""
    sub: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    conn.send(f"tcp://127.0.0.1:{sub.bind_to_random_port('tcp://127.0.0.1')}")
    received = 0
    while True:
        if sub.poll(100):
            sub.recv_multipart()
            received += 1
        elif conn.poll():
            if conn.recv() == "stop":
                return
            conn.send(received)
            received = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    args = parser.parse_args()
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    router = multiprocessing.get_context("spawn").Process(target=subscriber, args=(theirs,))
    router.start()
    endpoint = ours.recv()
    try:
        for events in [False, True] * args.rounds:
            root = tempfile.mkdtemp(dir=args.dir)
            try:
                announce = None
                if events:  # before the fill: connected by the time gc sends
                    target = parse_events_config(json.dumps({"endpoint": endpoint, "hwm": 100_000}))
                    announce = Announcer([target])
                fill(root, args.blocks)
                load = os.getloadavg()[0]
                cpu = time.process_time()
                result = one_pass(root, announce)
                result["cpu_s"] = round(time.process_time() - cpu, 3)  # publisher thread too
                if announce is not None:
                    result["sent"] = announce.report()
                    announce.close()
                    result["events_per_s"] = round(args.blocks / result["seconds"])
                ours.send("count")
                result.update(events=events, batches_received=ours.recv(), blocks=args.blocks)
                result["load_before"] = round(load, 2)
                print(json.dumps(result), flush=True)
            finally:
                shutil.rmtree(root)
    finally:
        ours.send("stop")
        router.join()


if __name__ == "__main__":
    main()
