"""Test-side names for the vLLM driver (llmkv_fs.harness.driver), with the
small thread counts a 2-core machine wants."""

import os
from typing import Any

from llmkv_fs.harness import driver
from llmkv_fs.harness.driver import (  # noqa: F401  (re-exported for tests)
    DEADLINE_S,
    MiB,
    Replica,
    make_keys,
    offloading_config,
    payload_for,
    wait_until,
)
from tests.kits.engine_kit import IO_WORKERS_ENV, PAUSE_DIR_ENV, Gate
from tests.kits.paused_tier import paused


def ours(root: str, **extra: Any) -> dict[str, Any]:
    """Our tier's config, in the test's io_mode (engine_kit.io_mode): as many
    worker processes as the I/O threads it would have otherwise, and the
    mode's pause points (tests/kits/paused_tier.py)."""
    config = {"n_read_threads": 2, "n_write_threads": 2, **extra}
    if "io_workers" not in config and os.environ.get(IO_WORKERS_ENV, "0") != "0":
        config["io_workers"] = config["n_read_threads"] + config["n_write_threads"]
    pause_dir = os.environ.get(PAUSE_DIR_ENV)
    tier = driver.ours(root, **config)
    return paused(tier, pause_dir) if pause_dir else tier


def builtin(root: str, **extra: Any) -> dict[str, Any]:
    return driver.builtin(root, **{"n_read_threads": 2, "n_write_threads": 2, **extra})


def start(replicas: list[Replica], *tiers: dict[str, Any], **config: Any) -> Replica:
    """A Replica over ``tiers`` (``config``: offloading_config's other
    keywords), put on the ``replicas`` fixture's list so teardown closes it."""
    replica = Replica(offloading_config(tiers=list(tiers), **config))
    replicas.append(replica)
    if tiers and tiers[0].get("io_workers") and replica.tier is not None:
        assert_io_mode(replica)
    return replica


def assert_io_mode(replica) -> None:
    """The replica's tier runs in the test's io_mode: worker mode must not
    have fallen back to I/O threads (nor threads mode started workers)."""
    workers = os.environ.get(IO_WORKERS_ENV, "0") != "0"
    assert bool(replica.tier.engine.io_workers) == workers, replica.tier.engine.io_workers


def read_primary(replica: Replica, key: bytes, ctx) -> bytes:
    """Bytes a GPU load of this (HIT) key would copy, via prepare_load."""
    with replica.manager.lock:
        spec = replica.manager.prepare_load([key], ctx)
    (chunk,) = spec.chunk_ids
    data = replica.rows[chunk].tobytes()
    with replica.manager.lock:
        replica.manager.complete_load([key], ctx)
    return data


def resolve(replica, keys, on_hit_pending=None) -> dict:
    """A fresh request looks ``keys`` up until each is HIT or MISS (see
    Replica.find for ``on_hit_pending``), then finishes."""
    ctx = replica.new_request()
    final, _ = replica.find(keys, ctx, on_hit_pending)
    replica.finish_request(ctx)
    return final


def store_burst_while_stalled(replica, keys, per_job: int = 3) -> None:
    """Submit ``keys`` as store jobs of ``per_job`` while the volume is held
    "slow" (every store block waits at the engine's enter pause point, in an
    I/O thread or a worker process: the test needs the ``io_mode`` fixture),
    then release it and settle: the executor takes what it can hold, the
    bounded queue takes what fits, and the rest of the burst is refused."""
    gate = Gate(replica.tier.engine, os.environ[PAUSE_DIR_ENV], kinds=("store",))
    assert not gate.opened.is_set(), "the test's gate is open already"
    try:
        for i in range(0, len(keys), per_job):
            replica.store(keys[i : i + per_job], settle=False)
    finally:
        gate.open()
    replica.settle()
