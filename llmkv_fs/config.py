"""Every tier setting in one place: its key, default, validation and docs.

vLLM hands a secondary tier's JSON dict to the tier constructor as keyword
arguments. ``TierSettings.from_mapping`` is the single gate those keys pass
through: an unknown key or a bad value raises ``TierConfigError`` naming the
key and what is valid, before any thread or file exists.

Each setting is declared once, as a field of ``TierSettings`` (type, default,
and in its metadata the doc, the check and whether vLLM's built-in fs tier
takes the same key); ``SETTINGS`` is the table view derived from those fields.
``docs/configuration.md`` is generated from ``SETTINGS`` (see
``llmkv-fs config-doc``) so the documentation cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from llmkv_fs.units import UnitError, parse_size

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


_DECLARED = "llmkv_fs.setting"  # the metadata key of a TierSettings field


@dataclasses.dataclass(frozen=True)
class _Declared:
    doc: str
    check: Callable[[str, Any], Any]
    vllm_builtin: bool


def _fail(key: str, value: Any, expected: str) -> TierConfigError:
    return TierConfigError(
        f"llmkv_fs: bad value for secondary tier key {key!r}: {value!r} (expected {expected})"
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


def _mode(required_bits: int, what: str) -> Callable[[str, Any], int]:
    # JSON has no octal literals; "0640" (a string) is what operators write.
    def check(key: str, value: Any) -> int:
        if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3,4}", value.strip()):
            mode = int(value.strip(), 8)
        elif isinstance(value, int) and not isinstance(value, bool):
            mode = value
        else:
            raise _fail(key, value, 'an octal mode string such as "0640"')
        if not 0 <= mode <= 0o7777:
            raise _fail(key, value, "a mode within 0o7777")
        if mode & required_bits != required_bits:
            raise _fail(key, value, f"a mode that keeps {what} ({required_bits:#o})")
        return mode

    return check


def _byte_size(key: str, value: Any) -> int:
    if isinstance(value, (str, int, float)):
        try:
            return parse_size(value)
        except UnitError:
            pass
    raise _fail(
        key,
        value,
        "a whole number of bytes from 0 to 2^63 - 1: an integer, or a string "
        'with a decimal or binary suffix such as "20GB" (20 * 10^9) or "20GiB" (20 * 2^30)',
    )


def _positive_seconds(high: float) -> Callable[[str, Any], float]:
    def check(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(key, value, f"seconds, a number in (0, {high:g}]")
        if not 0 < value <= high:
            raise _fail(key, value, f"seconds, a number in (0, {high:g}]")
        return float(value)

    return check


def _percent(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 100:
        raise _fail(key, value, "a percentage in (0, 100]")
    return float(value)


def _numa_node(key: str, value: Any) -> str | int:
    if isinstance(value, str) and value in ("auto", "off"):
        return value
    if value is None:
        return "off"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise _fail(key, value, '"auto", "off" or a NUMA node id (integer >= 0)')


IO_WORKERS_MAX = 256


def _io_workers(key: str, value: Any) -> str | int:
    if value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= IO_WORKERS_MAX:
        return value
    raise _fail(key, value, f'"auto" or an integer in [0, {IO_WORKERS_MAX}]')


def _declare(
    doc: str, check: Callable[[str, Any], Any], *, vllm_builtin: bool = False
) -> dict[str, _Declared]:
    return {_DECLARED: _Declared(doc, check, vllm_builtin)}


@dataclasses.dataclass(frozen=True)
class TierSettings:
    """Validated settings of one llmkv_fs tier. Immutable; safe to share
    between threads.

    Each field is a setting, declared once: its type and default here, its
    doc, check and vLLM flag in the field's metadata (``SETTINGS`` is the
    table view of these fields)."""

    root_dir: str = dataclasses.field(
        metadata=_declare(
            "Root directory of the shared cache volume.", _root_dir, vllm_builtin=True
        )
    )
    n_read_threads: int = dataclasses.field(
        default=16,
        metadata=_declare(
            "Load-priority I/O threads (they also drain stores when idle).",
            _int_between(1, 512),
            vllm_builtin=True,
        ),
    )
    n_write_threads: int = dataclasses.field(
        default=16,
        metadata=_declare(
            "Store-priority I/O threads (they also drain loads when idle).",
            _int_between(1, 512),
            vllm_builtin=True,
        ),
    )
    enable_kv_events: bool = dataclasses.field(
        default=False,
        metadata=_declare(
            "Emit BlockStored KV events for blocks that landed in this tier, and "
            "BlockRemoved for files it quarantined (needs KV cache events enabled "
            "globally).",
            _boolean,
            vllm_builtin=True,
        ),
    )
    locality: str | None = dataclasses.field(
        default=None,
        metadata=_declare(
            "Whether the volume is LOCAL or REMOTE to this instance (KV events).",
            _locality,
            vllm_builtin=True,
        ),
    )
    durability: str = dataclasses.field(
        default="none",
        metadata=_declare(
            "none: publish by rename only (a torn file after power loss is caught "
            "by the checksum and quarantined); file: fsync each block before the "
            "rename; full: also fsync the directory after the rename.",
            _one_of("none", "file", "full"),
        ),
    )
    checksum: bool = dataclasses.field(
        default=True,
        metadata=_declare(
            "Write an xxh3-64 checksum of every block and verify it on load. "
            "Off: the trailer still carries length and key, which are verified.",
            _boolean,
        ),
    )
    accept_trailerless: bool = dataclasses.field(
        default=False,
        metadata=_declare(
            "Also load trailer-less files of exactly one chunk (what vLLM's built-in "
            "fs tier writes), as unverified. Off by default: such a file carries no "
            "key or checksum, so a torn or damaged one would reach the CPU tier "
            "unchecked. Turn it on only for a volume shared with replicas running "
            "vLLM's built-in tier.",
            _boolean,
        ),
    )
    io_mode: str = dataclasses.field(
        default="auto",
        metadata=_declare(
            "auto: O_DIRECT where the volume accepts it (probed once), else "
            "buffered; direct: require O_DIRECT; buffered: never use it.",
            _one_of("auto", "direct", "buffered"),
        ),
    )
    numa_node: str | int = dataclasses.field(
        default="auto",
        metadata=_declare(
            "auto: pin I/O threads to the CPUs of the NUMA node holding the "
            "primary buffer (multi-node machines only); an integer: that node; "
            '"off": never pin.',
            _numa_node,
        ),
    )
    io_workers: str | int = dataclasses.field(
        default="auto",
        metadata=_declare(
            "Where blocks are moved. 0: on n_read_threads + n_write_threads threads "
            "inside vLLM's engine-core process (sharing its GIL). N: in N worker "
            "processes that map the CPU tier themselves (half of them load-first, "
            "half store-first; the thread counts are then unused); each costs "
            "about 2 MiB of page tables per GiB of CPU tier it touches. auto: "
            "processes when the process may use at least 6 CPUs (that many minus 2, "
            "for the scheduler and the conductor thread; at most 16; see "
            "docs/benchmarks.md), else threads. Processes need the "
            "CPU tier as shared memory (vLLM's is); otherwise threads are used and "
            "the log says why.",
            _io_workers,
        ),
    )
    max_pending_store_blocks: int = dataclasses.field(
        default=1024,
        metadata=_declare(
            "Store blocks allowed to wait for an I/O thread. A store job that "
            "would exceed it fails at once (the block stays in the CPU tier); a "
            "single job larger than the bound is accepted only into an empty queue.",
            _int_between(1, 1 << 24),
        ),
    )
    lookup_threads: int = dataclasses.field(
        default=4,
        metadata=_declare(
            "Threads that run one step's batched existence checks in parallel "
            "(each check is one metadata round trip on a network filesystem).",
            _int_between(1, 256),
        ),
    )
    job_timeout_s: float = dataclasses.field(
        default=30.0,
        metadata=_declare(
            "Deadline of one transfer job. A store past it fails (blocks in flight "
            "are abandoned and never published). A load past it fails its queued "
            "blocks at once; a load whose read is still inside the kernel is "
            "reported only when that read returns, because the kernel may still "
            "write into the CPU-tier chunk, which vLLM would reuse. While a job is "
            "overdue the volume counts as stalled: new jobs fail at once and "
            "lookups miss, until the stuck calls return. A lookup check waits at "
            "most min(job_timeout_s, 5 s) before answering miss.",
            _positive_seconds(86400),
        ),
    )
    max_usage_percent: float = dataclasses.field(
        default=95.0,
        metadata=_declare(
            "Space guard: when the volume (statvfs, sampled about once a second "
            "off the scheduler thread) is fuller than this, new stores are dropped "
            "(reported failed, counted) and loads continue.",
            _percent,
        ),
    )
    min_free_bytes: int = dataclasses.field(
        default=0,
        metadata=_declare(
            "Space guard: drop new stores while fewer bytes than this are free: an "
            "integer, or a size with a decimal or binary suffix (see Sizes below): "
            '"20GB" or "20G" is 20 * 10^9 bytes, "20GiB" or "20Gi" 20 * 2^30. '
            "ENOSPC also trips the guard, "
            "until free space has grown by one block per I/O thread (someone, e.g. "
            "gc, made room).",
            _byte_size,
        ),
    )
    file_mode: int = dataclasses.field(
        default=0o640,
        metadata=_declare(
            'Mode of block and config files ("0640"). KV bytes reveal prompt '
            "content, so others get nothing; the group may read, which is how "
            "replicas running as different users in one fsGroup share.",
            _mode(0o600, "owner read and write"),
        ),
    )
    dir_mode: int = dataclasses.field(
        default=0o770,
        metadata=_declare(
            'Mode of directories this tier creates ("0770"). Group write lets '
            "replicas and gc running as other users of the group add, "
            "quarantine and remove files.",
            _mode(0o700, "owner read, write and search"),
        ),
    )
    lease_interval_s: float = dataclasses.field(
        default=30.0,
        metadata=_declare(
            "How often the tier refreshes its lease file under the digest "
            "directory; gc treats a lease older than 4 intervals as dead.",
            _positive_seconds(3600),
        ),
    )

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
                        f"llmkv_fs: secondary tier key {setting.key!r} is required ({setting.doc})"
                    )
                continue
            values[setting.key] = setting.check(setting.key, config[setting.key])
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _table() -> tuple[Setting, ...]:
    table = []
    for f in dataclasses.fields(TierSettings):
        declared: _Declared = f.metadata[_DECLARED]  # KeyError: a field without _declare()
        required = f.default is dataclasses.MISSING
        table.append(
            Setting(
                f.name,
                None if required else f.default,
                declared.doc,
                declared.check,
                required=required,
                vllm_builtin=declared.vllm_builtin,
            )
        )
    return tuple(table)


SETTINGS: tuple[Setting, ...] = _table()
_BY_KEY = {s.key: s for s in SETTINGS}
