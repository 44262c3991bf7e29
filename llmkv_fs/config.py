"""Every tier setting in one place: its key, default, validation and docs.

vLLM hands a secondary tier's JSON dict to the tier constructor as keyword
arguments. ``TierSettings.from_mapping`` is the single gate those keys pass
through: an unknown key or a bad value raises ``TierConfigError`` naming the
key and what is valid, before any thread or file exists.

Each setting is declared once, as a field of ``TierSettings`` (type, default,
and in its metadata the doc, the check and whether vLLM's built-in fs tier
takes the same key; how, in declared.py); ``SETTINGS`` is the table view derived
from those fields.
Every check (the reusable ones live in checks.py) says what it accepts
(``Setting.valid``, e.g. the range of a number); the docs show it and a
refused value's error quotes it.
``docs/configuration.md`` is generated from ``SETTINGS`` (see
``llmkv-fs config-doc``) so the documentation cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from llmkv_fs.checks import (
    TierConfigError,
    boolean,
    byte_size,
    byte_size_at_least,
    directory_path,
    int_between,
    io_workers_count,
    key_files,
    key_id_or_null,
    locality,
    numa_node,
    octal_mode,
    one_of,
    option,
    or_null,
    percent,
    seconds,
)
from llmkv_fs.declared import Setting, declare, table_of
from llmkv_fs.rootlist import split_root_list

__all__ = [
    "SETTINGS",
    "Setting",
    "TierConfigError",
    "TierSettings",
    "setting_option",
    "store_queue_blocks",
]


@dataclasses.dataclass(frozen=True)
class TierSettings:
    """Validated settings of one llmkv_fs tier. Immutable; safe to share
    between threads.

    Each field is a setting, declared once: its type and default here, its
    doc, check and vLLM flag in the field's metadata (``SETTINGS`` is the
    table view of these fields)."""

    root_dir: str = dataclasses.field(
        metadata=declare(
            "Root directory of the shared cache volume.", directory_path, vllm_builtin=True
        )
    )
    path_sharding: str = dataclasses.field(
        default="none",
        metadata=declare(
            "none: root_dir is one directory (a comma in it is part of its name). "
            "by_block_hash: root_dir lists several roots separated by commas "
            '("/mnt/nvme0/kv,/mnt/nvme1/kv") and each block is stored whole on one '
            "of them, chosen from its hash by rendezvous hashing: reordering the "
            "list moves no block, adding an N-th root moves 1/N of them (a load "
            "also looks at a block's second choice, where it was written before). "
            "Each root holds the ordinary layout and is checked, probed, "
            "space-guarded and failed on its own. The key of vLLM's open "
            "multi-root PR, whose placement differs (docs/configuration.md).",
            one_of("none", "by_block_hash"),
        ),
    )
    require_mounted_root: bool = dataclasses.field(
        default=False,
        metadata=declare(
            "Refuse to start when root_dir is not on a mounted volume (its mount "
            "point is '/', the container's own disk), so an unmounted volume never "
            "becomes a cache on local disk. Off by default, as vLLM's built-in fs "
            "tier creates a missing root_dir wherever it is. Either way a running "
            "tier never recreates root_dir and fails the volume (stores refused, "
            "lookups miss) while root_dir is not the directory it started on.",
            boolean,
        ),
    )
    n_read_threads: int = dataclasses.field(
        default=16,
        metadata=declare(
            "Load-priority I/O threads (they also drain stores when idle).",
            int_between(1, 512),
            vllm_builtin=True,
        ),
    )
    n_write_threads: int = dataclasses.field(
        default=16,
        metadata=declare(
            "Store-priority I/O threads (they also drain loads when idle).",
            int_between(1, 512),
            vllm_builtin=True,
        ),
    )
    enable_kv_events: bool = dataclasses.field(
        default=False,
        metadata=declare(
            "Emit BlockStored KV events for blocks that landed in this tier, and "
            "BlockRemoved for files it quarantined (needs KV cache events enabled "
            "globally).",
            boolean,
            vllm_builtin=True,
        ),
    )
    locality: str | None = dataclasses.field(
        default=None,
        metadata=declare(
            "Whether the volume is LOCAL or REMOTE to this instance (KV events).",
            locality,
            vllm_builtin=True,
        ),
    )
    durability: str = dataclasses.field(
        default="none",
        metadata=declare(
            "none: publish by rename only (a torn file after power loss is caught "
            "by the checksum and quarantined); file: fsync each block before the "
            "rename; full: also fsync the directory after the rename.",
            one_of("none", "file", "full"),
        ),
    )
    checksum: bool = dataclasses.field(
        default=True,
        metadata=declare(
            "Write an xxh3-64 checksum of every block and verify it on load. "
            "Off: the trailer still carries length and key, which are verified; "
            "blocks are then counted unverified. A reader with checksum on never "
            "serves a block without a checksum as verified: it refuses blocks "
            "written with checksum off (load_failures reason no_checksum, the file "
            "is left in place) unless accept_trailerless is on, which serves them "
            "as unverified. Give every replica of a volume the same setting.",
            boolean,
        ),
    )
    accept_trailerless: bool = dataclasses.field(
        default=False,
        metadata=declare(
            "Also load trailer-less files of exactly one chunk (what vLLM's built-in "
            "fs tier writes), as unverified. Off by default: such a file carries no "
            "key or checksum, so a torn or damaged one would reach the CPU tier "
            "unchecked. Turn it on only for a volume shared with replicas running "
            "vLLM's built-in tier. With checksum on, it also admits (as unverified) "
            "blocks written with checksum off, which carry a key but no checksum.",
            boolean,
        ),
    )
    seal_key_files: tuple[tuple[int, str], ...] | None = dataclasses.field(
        default=None,
        metadata=declare(
            "Seal every block: AES-256-GCM, authenticated and bound to its place "
            "(model digest, rank, KV group, block hash), so nobody without a key reads "
            "a prompt from the volume or plants KV in it (docs/reliability.md, "
            '"Sealed blocks"). An object of key ids to files each holding one key '
            '({"1": "/var/run/secrets/llmkv/key-1"}), a mounted Secret: 32 random '
            "bytes as hex or base64 (openssl rand -base64 32), not readable by everyone; "
            "the file, and every directory and link on its path up to /, owned by the "
            "tier's user or root and writable by no one else (a sticky directory, like a "
            "Secret volume's root, only for entries of theirs). "
            "Blocks sealed with any listed key are read; new ones are sealed with "
            "seal_write_key_id. A block of a key not listed, or another key under a "
            "listed id, is a miss (load_failures reason foreign_key), left in place. "
            "Sealed blocks live in their own <model>_<digest> directory (the digest "
            "names the scheme, never a key), where unsealed deployments and vLLM's "
            "built-in tier never look. Not with accept_trailerless.",
            key_files,
        ),
    )
    seal_write_key_id: int | None = dataclasses.field(
        default=None,
        metadata=declare(
            "The key id of seal_key_files new blocks are sealed with; may be left "
            "out when there is one key. Rotation: add the new key, make it the write "
            "key on every replica, then remove the old one: its blocks are then "
            "foreign_key misses that a store recomputing them writes over (gc sweeps "
            "the rest like any block; no key needed).",
            key_id_or_null,
        ),
    )
    compiled_io: bool = dataclasses.field(
        default=True,
        metadata=declare(
            "Move blocks and check their presence in the compiled extensions "
            "(_bytepath, _presence: a job's slice or a chunk of keys in one call "
            "without the GIL) where the install built them and the kernel has "
            "openat2; off: the Python paths, which write and check the same files "
            "(slower on small blocks). The start-up log says which runs.",
            boolean,
        ),
    )
    io_mode: str = dataclasses.field(
        default="auto",
        metadata=declare(
            "auto: O_DIRECT where the volume accepts it (probed once), else "
            "buffered; direct: require O_DIRECT; buffered: never use it.",
            one_of("auto", "direct", "buffered"),
        ),
    )
    numa_node: str | int = dataclasses.field(
        default="auto",
        metadata=declare(
            "auto: pin I/O threads to the CPUs of the NUMA node holding the "
            "primary buffer (multi-node machines only); an integer: that node; "
            '"off": never pin.',
            numa_node,
        ),
    )
    io_workers: str | int = dataclasses.field(
        default="auto",
        metadata=declare(
            "Where blocks are moved. 0: on n_read_threads + n_write_threads threads "
            "inside vLLM's engine-core process (sharing its GIL). N: in N worker "
            "processes that map the CPU tier themselves (half of them load-first, "
            "half store-first; the thread counts are then unused); each costs "
            "about 2 MiB of page tables per GiB of CPU tier it maps (filled while "
            'idle for the first 16 GiB: docs/architecture.md, "Page tables ahead '
            'of the I/O"). auto: '
            "processes when the process may use at least 6 CPUs (that many minus 2, "
            "for the scheduler and the conductor thread; at most 16; see "
            "docs/benchmarks.md), else threads. Processes need the "
            "CPU tier as shared memory (vLLM's is); otherwise threads are used and "
            "the log says why.",
            io_workers_count,
        ),
    )
    io_workers_nice: int = dataclasses.field(
        default=0,
        metadata=declare(
            "Added to the nice value of each I/O worker process (0: as vLLM's "
            "engine-core process; 19: run only on CPU time nothing else wants). "
            "With it, io_workers may be the CPU count and the scheduler keeps its "
            "rate beside them (measured: docs/benchmarks.md). "
            "Worker processes only: an I/O thread (io_workers 0) shares the GIL "
            "with vLLM's scheduler, which would wait for a starved thread holding "
            "it, so threads always keep the engine's priority.",
            int_between(0, 19),
        ),
    )
    max_pending_store_bytes: int = dataclasses.field(
        default=2 << 30,
        metadata=declare(
            "Bytes of store blocks allowed to wait for an I/O thread or worker: a "
            "queued store keeps its CPU-tier chunk from being reused, and the "
            "loads behind a long queue wait, whatever the chunk size. A store job "
            "that would exceed it fails at once (the chunk stays in the CPU tier, "
            "store_failures reason queue_full); a single job larger than the "
            "bound is accepted only into an empty queue. 2 GiB is 1,024 chunks of "
            "2 MiB or 32,768 of 64 KiB (a tensor-parallel rank's slice).",
            byte_size_at_least(1),
        ),
    )
    max_pending_store_blocks: int | None = dataclasses.field(
        default=None,
        metadata=declare(
            "Also bound the store queue by a count of blocks (the older form of "
            "the bound, which meant 2 GiB at 2 MiB chunks but 64 MiB at 64 KiB); "
            "null: max_pending_store_bytes alone.",
            or_null(int_between(1, 1 << 24)),
        ),
    )
    lookup_threads: int = dataclasses.field(
        default=32,
        metadata=declare(
            "Threads that run one step's batched existence checks in parallel. On a "
            "network filesystem each check waits on the server once for every level "
            "of the block's path the client has not cached (its name, and the two "
            "fan-out directories above it), and a long prompt's checks must all "
            "answer within the lookup deadline (min(job_timeout_s, 5 s)) or miss.",
            int_between(1, 256),
        ),
    )
    job_timeout_s: float = dataclasses.field(
        default=30.0,
        metadata=declare(
            "Deadline of one transfer job. A store past it fails (blocks in flight "
            "are abandoned and never published). A load past it fails its queued "
            "blocks at once; a load whose read is still inside the kernel is "
            "reported only when that read returns, because the kernel may still "
            "write into the CPU-tier chunk, which vLLM would reuse. While a job is "
            "overdue the volume counts as stalled: new jobs fail at once and "
            "lookups miss, until the stuck calls return. A lookup check waits at "
            "most min(job_timeout_s, 5 s) before answering miss.",
            seconds(0.1, 86400),
        ),
    )
    max_usage_percent: float = dataclasses.field(
        default=95.0,
        metadata=declare(
            "Space guard: when the volume (statvfs, sampled about once a second "
            "off the scheduler thread) is fuller than this, new stores are dropped "
            "(reported failed, counted) and loads continue.",
            percent,
        ),
    )
    min_free_bytes: int = dataclasses.field(
        default=0,
        metadata=declare(
            "Space guard: drop new stores while fewer bytes than this are free: an "
            "integer, or a size with a decimal or binary suffix (see Sizes below): "
            '"20GB" or "20G" is 20 * 10^9 bytes, "20GiB" or "20Gi" 20 * 2^30. '
            "ENOSPC also trips the guard, "
            "until free space has grown by one block more than the tier can have in "
            "flight (one slice per I/O thread, two per I/O worker process; a slice is "
            "up to 64 blocks of one job, at most 4 MiB of them, or one larger block), "
            "or by a tenth of the bytes in use at the failure where that is less (gc's "
            "default band frees a quarter of a full volume): someone, e.g. gc, made room.",
            byte_size,
        ),
    )
    file_mode: int = dataclasses.field(
        default=0o640,
        metadata=declare(
            'Mode of block and config files ("0640"). KV bytes reveal prompt '
            "content, so others get nothing; the group may read, which is how "
            "replicas running as different users in one fsGroup share.",
            octal_mode(0o600, "owner read and write"),
        ),
    )
    dir_mode: int = dataclasses.field(
        default=0o770,
        metadata=declare(
            'Mode of directories this tier creates ("0770"). Group write lets '
            "replicas and gc running as other users of the group add, "
            "quarantine and remove files.",
            octal_mode(0o700, "owner read, write and search"),
        ),
    )
    lease_interval_s: float = dataclasses.field(
        default=30.0,
        metadata=declare(
            "How often the tier refreshes its lease file under the digest "
            "directory; gc treats a lease older than 4 intervals as dead. The "
            "housekeeping thread wakes twice per interval (at least once a "
            "second); below 1 s is for tests.",
            seconds(0.1, 3600),
        ),
    )
    failed_load_miss_s: float = dataclasses.field(
        default=60.0,
        metadata=declare(
            "How long a block whose load failed in a way that would repeat -- an "
            "I/O error (EIO), a bad file that could not be moved to .quarantine/, "
            "a file without the checksum this reader wants -- answers miss to new "
            "lookups without being read again (at most 65536 such blocks are "
            "remembered). Without it every new request would find the file, load "
            "it and fail again. A repaired file is found again after this long.",
            seconds(1, 3600),
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
        settings = cls(**values)
        settings.root_dirs  # noqa: B018  # the list's spelling checked now, naming the entry
        settings.check_sealing()
        return settings

    def check_sealing(self) -> None:
        """The sealing settings agree with each other and the rest (the key
        files themselves are read at start-up: volume/keyfiles.py)."""
        ids = [key_id for key_id, _ in self.seal_key_files or ()]
        if self.seal_write_key_id is not None and self.seal_write_key_id not in ids:
            raise TierConfigError(
                f"llmkv_fs: seal_write_key_id {self.seal_write_key_id} is not among the "
                f"seal_key_files ids {ids}"
            )
        if ids and self.accept_trailerless:
            raise TierConfigError(
                "llmkv_fs: seal_key_files and accept_trailerless exclude each other: a "
                "trailer-less file is neither sealed nor authenticated"
            )

    @property
    def root_dirs(self) -> tuple[str, ...]:
        """The roots this tier stores on: root_dir itself, or with
        path_sharding by_block_hash its comma-separated entries (raises
        RootListError naming a bad entry)."""
        if self.path_sharding == "none":
            return (self.root_dir,)
        return split_root_list("root_dir", self.root_dir)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SETTINGS: tuple[Setting, ...] = table_of(TierSettings)
_BY_KEY = {s.key: s for s in SETTINGS}


def setting_option(key: str) -> Callable[[str], Any]:
    """An argparse ``type=`` for a command-line option that sets ``key``
    (``llmkv-fs bench --io-workers``): the setting's own check."""
    return option(_BY_KEY[key].check)


def store_queue_blocks(settings: TierSettings, block_size: int) -> int:
    """The store queue's bound in blocks of ``block_size`` bytes: what
    ``max_pending_store_bytes`` holds (at least one), and no more than
    ``max_pending_store_blocks`` where that is set."""
    blocks = max(1, settings.max_pending_store_bytes // block_size)
    if settings.max_pending_store_blocks is not None:
        blocks = min(blocks, settings.max_pending_store_blocks)
    return blocks
