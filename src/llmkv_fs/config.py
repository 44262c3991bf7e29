"""Every tier setting in one place: its key, default, validation and docs.

vLLM hands a secondary tier's JSON dict to the tier constructor as keyword
arguments. ``TierSettings.from_mapping`` is the single gate those keys pass
through: an unknown key or a bad value raises ``TierConfigError`` naming the
key and what is valid, before any thread or file exists.

``docs/configuration.md`` is generated from ``SETTINGS`` (see
``llmkv-fs config-doc``) so the documentation cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SETTINGS", "Setting", "TierConfigError", "TierSettings"]


class TierConfigError(ValueError):
    """A secondary-tier config key is unknown or has a bad value."""


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    doc: str
    check: Callable[[str, Any], Any]
    required: bool = False
    vllm_builtin: bool = False  # accepted by vLLM's own fs tier with the same meaning


def _fail(key: str, value: Any, expected: str) -> TierConfigError:
    return TierConfigError(
        f"llmkv_fs: bad value for secondary tier key {key!r}: {value!r} "
        f"(expected {expected})"
    )


def _int_between(low: int, high: int) -> Callable[[str, Any], int]:
    def check(key: str, value: Any) -> int:
        # bool is an int subclass; "true" threads is a config mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(key, value, f"an integer in [{low}, {high}]")
        if not low <= value <= high:
            raise _fail(key, value, f"an integer in [{low}, {high}]")
        return value

    return check


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, value, "true or false")
    return value


def _one_of(*choices: str | None) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value not in choices:
            shown = ", ".join("null" if c is None else c for c in choices)
            raise _fail(key, value, f"one of {shown}")
        return value

    return check


def _root_dir(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(key, value, "a non-empty directory path")
    if "\0" in value:
        raise _fail(key, value, "a path without NUL bytes")
    return value


def _locality(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value.upper() in ("LOCAL", "REMOTE"):
        return value.upper()
    raise _fail(key, value, "LOCAL, REMOTE or null")


def _numa_node(key: str, value: Any) -> str | int:
    if value in ("auto", "off"):
        return value
    if value is None:
        return "off"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise _fail(key, value, '"auto", "off" or a NUMA node id (integer >= 0)')


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "root_dir", None, "Root directory of the shared cache volume.",
        _root_dir, required=True, vllm_builtin=True,
    ),
    Setting(
        "n_read_threads", 16,
        "Load-priority I/O threads (they also drain stores when idle).",
        _int_between(1, 512), vllm_builtin=True,
    ),
    Setting(
        "n_write_threads", 16,
        "Store-priority I/O threads (they also drain loads when idle).",
        _int_between(1, 512), vllm_builtin=True,
    ),
    Setting(
        "enable_kv_events", False,
        "Emit BlockStored KV events for blocks that landed in this tier "
        "(needs KV cache events enabled globally).",
        _boolean, vllm_builtin=True,
    ),
    Setting(
        "locality", None,
        "Whether the volume is LOCAL or REMOTE to this instance (KV events).",
        _locality, vllm_builtin=True,
    ),
    Setting(
        "durability", "none",
        "none: publish by rename only (a torn file after power loss is caught "
        "by the checksum and quarantined); file: fsync each block before the "
        "rename; full: also fsync the directory after the rename.",
        _one_of("none", "file", "full"),
    ),
    Setting(
        "checksum", True,
        "Write an xxh3-64 checksum of every block and verify it on load. "
        "Off: the trailer still carries length and key, which are verified.",
        _boolean,
    ),
    Setting(
        "accept_trailerless", True,
        "Load trailer-less files of exactly one chunk (what vLLM's built-in fs "
        "tier writes) as unverified. Set false on a volume only llmkv_fs writes, "
        "so nothing unverified ever reaches the CPU tier.",
        _boolean,
    ),
    Setting(
        "io_mode", "auto",
        "auto: O_DIRECT where the volume accepts it (probed once), else "
        "buffered; direct: require O_DIRECT; buffered: never use it.",
        _one_of("auto", "direct", "buffered"),
    ),
    Setting(
        "numa_node", "auto",
        'auto: pin I/O threads to the CPUs of the NUMA node holding the '
        'primary buffer (multi-node machines only); an integer: that node; '
        '"off": never pin.',
        _numa_node,
    ),
    Setting(
        "max_pending_store_blocks", 1024,
        "Store blocks allowed to wait for an I/O thread. A store job that "
        "would exceed it fails at once (the block stays in the CPU tier); a "
        "single job larger than the bound is accepted only into an empty queue.",
        _int_between(1, 1 << 24),
    ),
    Setting(
        "lookup_threads", 4,
        "Threads that run one step's batched existence checks in parallel "
        "(each check is one metadata round trip on a network filesystem).",
        _int_between(1, 256),
    ),
)

_BY_KEY = {s.key: s for s in SETTINGS}


@dataclasses.dataclass(frozen=True)
class TierSettings:
    """Validated settings of one llmkv_fs tier. Immutable; safe to share
    between threads."""

    root_dir: str
    n_read_threads: int = 16
    n_write_threads: int = 16
    enable_kv_events: bool = False
    locality: str | None = None
    durability: str = "none"
    checksum: bool = True
    accept_trailerless: bool = True
    io_mode: str = "auto"
    numa_node: str | int = "auto"
    max_pending_store_blocks: int = 1024
    lookup_threads: int = 4

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> TierSettings:
        unknown = sorted(set(config) - set(_BY_KEY))
        if unknown:
            raise TierConfigError(
                f"llmkv_fs: unknown secondary tier key(s) {', '.join(map(repr, unknown))}; "
                f"valid keys: {', '.join(sorted(_BY_KEY))}"
            )
        values: dict[str, Any] = {}
        for setting in SETTINGS:
            if setting.key not in config:
                if setting.required:
                    raise TierConfigError(
                        f"llmkv_fs: secondary tier key {setting.key!r} is required "
                        f"({setting.doc})"
                    )
                continue
            values[setting.key] = setting.check(setting.key, config[setting.key])
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _defaults_match() -> None:
    # The dataclass defaults and the SETTINGS table must agree; checked at
    # import so a drift fails every test run, not a production start-up.
    for f in dataclasses.fields(TierSettings):
        setting = _BY_KEY[f.name]
        if not setting.required and f.default != setting.default:
            raise AssertionError(f"default of {f.name} differs from SETTINGS")
    if set(_BY_KEY) != {f.name for f in dataclasses.fields(TierSettings)}:
        raise AssertionError("SETTINGS and TierSettings list different keys")


_defaults_match()
