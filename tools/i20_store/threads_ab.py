"""2 I/O threads in one process: BlockIO.store on tmpfs, hash in 1 MiB pieces
(what I/O threads use), write order before vs after, alternating rounds."""

import os
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))
import mmap

from bench_support import IDENTITY, make_keys

from llmkv_fs.engine.block import blockio as B
from llmkv_fs.engine.block import piecewise as P
from llmkv_fs.engine.block.blockio import BlockIO, IoOptions, probe_o_direct
from llmkv_fs.layout.paths import CacheLayout

where, rounds, nblocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
block = 2 << 20
mm = mmap.mmap(-1, 64 * block)
view = memoryview(mm)
tail = os.urandom(block)
for i in range(64):
    mm[i * block : (i + 1) * block] = tail
res = {"before": [], "after": []}
for r in range(rounds):
    for order in ["before", "after"] if r % 2 == 0 else ["after", "before"]:
        B.write_hashing = P._ORDERS[order]
        root = os.path.join(where, f"t{r}{order}")
        os.makedirs(root)
        layout = CacheLayout.for_identity(root, IDENTITY)
        os.makedirs(layout.rank_dir, exist_ok=True)
        bio = BlockIO(
            layout, IoOptions(block, probe_o_direct(root), False, False, True, hash_chunk=1 << 20)
        )
        keys = make_keys(nblocks, f"{r}{order}")

        def th(w, bio=bio, keys=keys):
            for i in range(w, nblocks, 2):
                bio.store(keys[i], view[(i % 64) * block : (i % 64 + 1) * block])

        ts = [threading.Thread(target=th, args=(w,)) for w in range(2)]
        t = time.perf_counter()
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        res[order].append(nblocks * block / (time.perf_counter() - t) / 1e9)
        shutil.rmtree(root)
for k, v in res.items():
    print(k, f"median {statistics.median(v):.2f} GB/s", [round(x, 2) for x in v])
print("load", os.getloadavg())
