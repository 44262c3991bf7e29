"""Test-side names for the vLLM driver (llmkv_fs.tier.driver), with the
small thread counts a 2-core machine wants."""

from typing import Any

from llmkv_fs.tier import driver
from llmkv_fs.tier.driver import (  # noqa: F401  (re-exported for tests)
    DEADLINE_S,
    MiB,
    Replica,
    make_keys,
    offloading_config,
    payload_for,
    wait_until,
)


def ours(root: str, **extra: Any) -> dict[str, Any]:
    return driver.ours(root, **{"n_read_threads": 2, "n_write_threads": 2, **extra})


def builtin(root: str, **extra: Any) -> dict[str, Any]:
    return driver.builtin(root, **{"n_read_threads": 2, "n_write_threads": 2, **extra})
