"""End to end, KV events: a real ``vllm serve`` (vLLM's CPU build) with
``--kv-events-config`` and our tier's ``enable_kv_events`` announces a
prompt's chunks stored on the STORAGE medium; ``llmkv-fs gc`` evicting
them announces them removed; a real ZMQ subscriber (the router's view,
tests/kits/events_kit.py, decoding with vLLM's own classes) finds that both
name exactly the hashes of the prompt's block files. A router that learned
the prompt from the server can forget it from gc.

vLLM's KV block here is 32 tokens (the CPU build's least) and a chunk 128:
a chunk spans four KV blocks, the case where the file alone could not say which GPU blocks it
holds -- the connector names a chunk by its own hash (docs/kv-events.md).

One server per I/O mode (~1 min to start on 2 cores). Nothing waits for a
window: every wait polls for a state, its deadline bounds a hang only.
"""

from __future__ import annotations

import itertools
import json

import pytest

from llmkv_fs.ops.events.announcer import Announcer
from llmkv_fs.ops.events.config import parse_events_config
from tests.kits import KITS, e2e_kit
from tests.kits.e2e_kit import prompt
from tests.kits.events_kit import (
    Router,
    connect_announcer,
    gc_announcing,
    read_announcer,
    volume_hashes,
)
from tools.e2e.server import ServeConfig, Server, block_files, temp_files, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

CHUNK_TOKENS = 128  # tokens per block file
BLOCK_TOKENS = 32  # vLLM's KV block: four per chunk
WARM_TOKENS = 96  # three KV blocks, no full chunk: GPU events only
PROMPT_TOKENS = 2000  # 15 full chunks
START_TIMEOUT_S = 600
SETTLE_TIMEOUT_S = 300
IO_MODES = {"threads": {}, "workers": {"io_workers": 2}}


def serving_with_events(e2e_env, base, router: Router, mode: str) -> Server:
    venv, model, site = e2e_env
    root = base / "kv"
    root.mkdir(parents=True)
    config = ServeConfig(
        venv=venv,
        model=model,
        root_dir=str(root),
        pythonpath=[str(site), str(KITS)],
        tier_options={**IO_MODES[mode], "enable_kv_events": True},
        chunk_tokens=CHUNK_TOKENS,
        block_tokens=BLOCK_TOKENS,
        dtype="float32",
        log_dir=str(base),
        # The router binds, the server's publisher connects (as to llm-d's indexer).
        kv_events={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": router.endpoint,
            "topic": "kv@server",
        },
    )
    return Server(config, f"events-{mode}")


def subscribed(server: Server, router: Router) -> None:
    """Until the publisher's connection carries the router's subscription
    a PUB socket drops what it sends: short prompts (GPU blocks, no chunk
    for our tier) until one batch arrives."""
    seeds = itertools.count(1000)
    wait_for(
        lambda: server.complete(prompt(next(seeds), WARM_TOKENS)) and router.drain(1000),
        START_TIMEOUT_S,
        f"the server's events reaching the router ({server.log_path})",
        every_s=0,
    )


@pytest.mark.parametrize("mode", list(IO_MODES))
def test_gc_removes_exactly_the_hashes_the_server_stored(e2e_env, e2e_base, mode):
    router = Router()
    server = serving_with_events(e2e_env, e2e_base / f"events_{mode}", router, mode)
    root = server.config.root_dir
    try:
        e2e_kit.start(server, START_TIMEOUT_S)
        subscribed(server, router)
        assert volume_hashes(root) == set() and router.stored == set()

        server.complete(prompt(7, PROMPT_TOKENS))
        chunks = PROMPT_TOKENS // CHUNK_TOKENS

        def settled() -> bool:
            router.drain(100)
            on_volume = len(block_files(root)) >= chunks and not temp_files(root)
            return on_volume and router.stored >= volume_hashes(root)

        wait_for(settled, SETTLE_TIMEOUT_S, f"{chunks} chunks stored and announced")
        files = volume_hashes(root)
        assert len(files) == chunks
        assert router.stored == files  # one hash a chunk, the file's own
        # Before the stop: vLLM's API server logs one of its own as its engine ends.
        assert "Traceback" not in server.log_text(), server.log_path
    finally:
        server.stop()

    announce = Announcer([parse_events_config(json.dumps({"endpoint": router.endpoint}))])
    try:
        connect_announcer(router, announce)
        report = gc_announcing(root, announce, max_bytes=0)
        read_announcer(router, announce)
    finally:
        announce.close()
        router.close()
    assert report.capacity["evicted_blocks"] == chunks
    assert volume_hashes(root) == set()
    assert router.removed == files  # the same hashes, each told gone
    assert router.index == set()
