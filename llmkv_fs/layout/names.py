"""Every name on the volume: one function builds each kind, one parses it.
Pure string functions, no I/O; the engine, the tier and the ops tools build
and recognise names only through these (tests/layout/test_names.py round-trips
every kind and feeds the parsers look-alikes).

    <root>/<model>_<digest>/                         digest_dir_name    parse_digest_dir_name
    <root>/<model>_<digest>/config.json              config_path        (== CONFIG_FILENAME)
    <root>/<model>_<digest>/leases/<host>~<pid>~<started_ns>.json
                                                     lease_file_name    parse_lease_file_name
    <root>/<model>_<digest>_r<rank>/                 rank_dir_name      parse_rank_dir_name
    <rank dir>/<hhh>/<hh>_g<group>/<hash>.bin        block_rel_path     parse_block_rel_path
    <rank dir>/.quarantine/<hash>.bin.<reason>.<ns>  quarantine_path    parse_quarantine_name
    <dir>/.<final name>.<host>~<pid>~<nonce>.tmp     temp_name          parse_temp_name
    <rank dir>/.llmkv_fs_o_direct_probe.<host>~<pid> probe_name         parse_probe_name
    <root>/.llmkv-gc-trash~<digest>[_r<rank>]~<pid>~<ns>
                                                     trash_path         is_trash_name
    <root>/.llmkv-gc.lock                            gc_lock_path       (== GC_LOCK_NAME)
    <any dir>/.nfs<hex>              (NFS clients')  is_silly_rename_name

(``temp_name``, ``probe_name``: the last component alone, created relative
to the directory's descriptor; ``block_rel_parts``: a block's components.)
vLLM's built-in tier writes ``<hash>.bin_<random>.tmp`` next to a block and
probes O_DIRECT with ``.o_direct_probe_<random>.tmp``; we never build those,
only recognise them (``is_vllm_temp_name``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

__all__ = [
    "BLOCK_SUFFIX",
    "CONFIG_FILENAME",
    "DIGEST_LEN",
    "GC_LOCK_NAME",
    "GROUP_BYTES",
    "LEASES_DIRNAME",
    "LEASE_SUFFIX",
    "QUARANTINE_DIRNAME",
    "TRASH_PREFIX",
    "DigestDirName",
    "LayoutError",
    "LeaseName",
    "QuarantineName",
    "RankDirName",
    "TempName",
    "WriterTag",
    "block_place",
    "block_rel_parts",
    "block_rel_path",
    "config_path",
    "digest_dir_name",
    "gc_lock_path",
    "in_quarantine",
    "is_block_name",
    "is_lease_name",
    "is_silly_rename_name",
    "is_temp_name",
    "is_trash_name",
    "is_vllm_temp_name",
    "lease_dir",
    "lease_file_name",
    "offload_key",
    "parse_block_path",
    "parse_block_rel_path",
    "parse_digest_dir_name",
    "parse_lease_file_name",
    "parse_probe_name",
    "parse_quarantine_name",
    "parse_rank_dir_name",
    "parse_temp_name",
    "probe_name",
    "quarantine_dir",
    "quarantine_path",
    "rank_dir_name",
    "safe_model_component",
    "store_place",
    "temp_name",
    "temp_writer",
    "trash_path",
]

CONFIG_FILENAME = "config.json"
BLOCK_SUFFIX = ".bin"
QUARANTINE_DIRNAME = ".quarantine"
LEASES_DIRNAME = "leases"
LEASE_SUFFIX = ".json"
# Hidden names gc renames digests to before deleting them (see ops/gc/actions.py).
TRASH_PREFIX = ".llmkv-gc-trash~"
GC_LOCK_NAME = ".llmkv-gc.lock"
_PROBE_PREFIX = ".llmkv_fs_o_direct_probe."
DIGEST_LEN = 12
_NAME_MAX = 255  # bytes in one path component on every Linux filesystem we target
# An OffloadKey is <block hash><4-byte big-endian KV group index>: packed by
# offload_key, taken apart by block_rel_parts (inline: per block moved).
GROUP_BYTES = 4


class LayoutError(ValueError):
    """A name from the configuration cannot become a safe path component."""


# -- digest and rank directories ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DigestDirName:
    model: str  # the model name as a path component ('/' already '_')
    digest: str


@dataclasses.dataclass(frozen=True)
class RankDirName:
    digest_dir_name: str
    rank: int


_DIGEST_DIR_RE = re.compile(rf"(?P<model>.+)_(?P<digest>[0-9a-f]{{{DIGEST_LEN}}})")
_RANK_DIR_RE = re.compile(rf"(?P<base>.+_[0-9a-f]{{{DIGEST_LEN}}})_r(?P<rank>[0-9]+)")


def safe_model_component(model_name: str) -> str:
    """vLLM's escaping ('/' -> '_'), plus the checks it leaves out.

    With '/' gone and the digest appended, no model name can climb out of the
    root ("../x" becomes ".._x_<digest>"); NUL and over-long names would only
    fail later with an obscure OSError, so they are refused here.
    """
    if "\0" in model_name:
        raise LayoutError(f"model name {model_name!r} contains a NUL byte")
    safe = model_name.replace("/", "_")
    # Longest sibling we create: the rank directory, with room for 5-digit ranks.
    if len(rank_dir_name(f"{safe}_{'0' * DIGEST_LEN}", 99999).encode()) > _NAME_MAX:
        raise LayoutError(
            f"model name {model_name!r} is too long for a path component "
            f"({_NAME_MAX} bytes including the digest suffix)"
        )
    return safe


def digest_dir_name(model_name: str, digest: str) -> str:
    """``<model>_<digest>``: one path component (it can be neither "." nor
    ".." nor contain "/"), so it stays inside the root."""
    return f"{safe_model_component(model_name)}_{digest}"


def parse_digest_dir_name(name: str) -> DigestDirName | None:
    match = _DIGEST_DIR_RE.fullmatch(name)
    return DigestDirName(match["model"], match["digest"]) if match else None


def rank_dir_name(digest_dir: str, rank: int) -> str:
    """The ``_r<rank>`` sibling of a digest directory (its name or its path)."""
    return f"{digest_dir}_r{rank}"


def parse_rank_dir_name(name: str) -> RankDirName | None:
    """The digest directory a ``<model>_<digest>_r<rank>`` sibling belongs to."""
    match = _RANK_DIR_RE.fullmatch(name)
    return RankDirName(match["base"], int(match["rank"])) if match else None


def config_path(digest_dir: str) -> str:
    return f"{digest_dir}/{CONFIG_FILENAME}"


# -- block files -------------------------------------------------------------------


def offload_key(block_hash: bytes, group: int = 0) -> bytes:
    """The OffloadKey of ``block_hash`` in KV cache group ``group`` (vLLM's
    ``make_offload_key``, for code that does not import vLLM)."""
    return block_hash + group.to_bytes(GROUP_BYTES, "big")


def block_rel_path(key: bytes) -> str:
    """``<hhh>/<hh>_g<group>/<hash>.bin``: where a key's block lives below its
    rank directory (vLLM's FileMapper fan-out, byte for byte)."""
    return "/".join(block_rel_parts(key))


def block_rel_parts(key: bytes) -> tuple[str, str, str]:
    """``block_rel_path``'s components (inline: runs for every block moved)."""
    h = key[:-GROUP_BYTES].hex()
    group = int.from_bytes(key[-GROUP_BYTES:], "big")
    return h[:3], f"{h[3:5]}_g{group}", f"{h}{BLOCK_SUFFIX}"


def block_place(rank_rel: str, key: bytes) -> tuple[str, str]:
    """The block's directory below the root (``rank_rel``, the rank
    directory, above ``<hhh>/<hh>_g<group>``) and its file name."""
    hhh, leaf, name = block_rel_parts(key)
    return f"{rank_rel}/{hhh}/{leaf}", name


# The group is a decimal u32 without leading zeros (as block_rel_path writes it).
_BLOCK_REL_RE = re.compile(
    r"[0-9a-f]{3}/[0-9a-f]{2}_g(?P<group>0|[1-9][0-9]{0,9})/"
    r"(?P<hash>[0-9a-f]+)\.bin"
)


def parse_block_rel_path(rel: str) -> bytes | None:
    """The OffloadKey whose ``block_rel_path`` is ``rel``, or None."""
    match = _BLOCK_REL_RE.fullmatch(rel)
    if match is None or len(match["hash"]) % 2 or int(match["group"]) >= 1 << 32:
        return None
    key = offload_key(bytes.fromhex(match["hash"]), int(match["group"]))
    # Round trip through the builder, so a reader can never disagree with the
    # tier about which key a path holds (e.g. a hash too short for the
    # <hhh>/<hh> fan-out, or fan-out directories of another hash).
    return key if block_rel_path(key) == rel else None


def parse_block_path(rank_dir: str, path: str) -> bytes | None:
    """The OffloadKey whose block path under ``rank_dir`` is ``path``, or None
    if ``path`` is not a block path of ``rank_dir`` (a stray or misplaced file)."""
    prefix = rank_dir.rstrip("/") + "/"
    if not path.startswith(prefix):
        return None
    return parse_block_rel_path(path[len(prefix) :])


def is_block_name(name: str) -> bool:
    """A name a block file has (``<hash>.bin``, not hidden). Says nothing of
    what the entry is: a symlink or FIFO may carry such a name too."""
    return name.endswith(BLOCK_SUFFIX) and not name.startswith(".")


# -- quarantine --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuarantineName:
    block_name: str
    reason: str  # BlockFileError.reason, or one of verify's own tokens
    moved_ns: int


def quarantine_dir(rank_dir: str) -> str:
    return f"{rank_dir}/{QUARANTINE_DIRNAME}"


def in_quarantine(rank_dir: str, path: str) -> bool:
    """Whether ``path`` is the quarantine directory of ``rank_dir`` or lies in it."""
    qdir = quarantine_dir(rank_dir)
    return path == qdir or path.startswith(qdir + "/")


def quarantine_path(rank_dir: str, block_name: str, reason: str, moved_ns: int) -> str:
    return f"{quarantine_dir(rank_dir)}/{block_name}.{reason}.{moved_ns}"


def parse_quarantine_name(name: str) -> QuarantineName | None:
    parts = name.rsplit(".", 2)
    if len(parts) == 3 and _is_decimal(parts[2]) and parts[0].endswith(BLOCK_SUFFIX):
        return QuarantineName(parts[0], parts[1], int(parts[2]))
    return None


def _is_decimal(text: str) -> bool:
    return text.isascii() and text.isdigit()


# -- temp files and probes: named after their writer -------------------------------


@dataclasses.dataclass(frozen=True)
class TempName:
    host: str
    pid: int
    nonce: str
    final_name: str = ""  # the name it is renamed to when published


class WriterTag(NamedTuple):
    """Who wrote a temp file or probe (a tuple: gc unpacks it)."""

    host: str
    pid: int


# ".<final name>.<host>~<pid>~<nonce>.tmp": hidden (a leading dot keeps it out
# of globbing tools), and it names its writer so gc can prove a writer dead.
# Host names contain dots, so the final name is anchored on its suffix.
_TEMP_RE = re.compile(
    r"\.(?P<final>.+?\.(?:bin|json))\.(?P<host>[^~/]+)~(?P<pid>[0-9]+)~(?P<nonce>[0-9a-z]+)\.tmp"
)


def temp_name(final_name: str, host: str, pid: int, nonce: str) -> str:
    return f".{final_name}.{host}~{pid}~{nonce}.tmp"


def store_place(rank_rel: str, key: bytes, host: str, pid: int, nonce: str) -> tuple[str, str, str]:
    """Where a store of ``key`` writes: ``block_place``'s directory and file
    name, and the temp name this writer (``host``, ``pid``, ``nonce``: a
    thread's) fills before the rename."""
    rel_dir, name = block_place(rank_rel, key)
    return rel_dir, name, temp_name(name, host, pid, nonce)


def parse_temp_name(name: str) -> TempName | None:
    match = _TEMP_RE.fullmatch(name)
    if match is None:
        return None
    return TempName(match["host"], int(match["pid"]), match["nonce"], match["final"])


_PROBE_RE = re.compile(rf"{re.escape(_PROBE_PREFIX)}(?P<host>[^~/]+)~(?P<pid>[0-9]+)")


def probe_name(host: str, pid: int) -> str:
    return f"{_PROBE_PREFIX}{host}~{pid}"


def parse_probe_name(name: str) -> WriterTag | None:
    match = _PROBE_RE.fullmatch(name)
    return WriterTag(match["host"], int(match["pid"])) if match else None


_VLLM_TEMP_RE = re.compile(r"(?:[0-9a-f]+\.bin|\.o_direct_probe)_[0-9]+\.tmp")


def is_vllm_temp_name(name: str) -> bool:
    """A temp file of vLLM's built-in tier (its names do not say who wrote them)."""
    return _VLLM_TEMP_RE.fullmatch(name) is not None


def temp_writer(name: str) -> WriterTag | None:
    """The process that created a temp file or O_DIRECT probe, where its name
    says so (ours do; vLLM's built-in tier's do not)."""
    if not name.startswith("."):
        return None
    parsed = parse_temp_name(name)
    if parsed is not None:
        return WriterTag(parsed.host, parsed.pid)
    return parse_probe_name(name)


def is_temp_name(name: str) -> bool:
    """Ours (temp file or probe, writer named) or vLLM's built-in tier's."""
    return (name.startswith(".") or name.endswith(".tmp")) and (
        temp_writer(name) is not None or is_vllm_temp_name(name)
    )


# -- leases ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeaseName:
    host: str
    pid: int
    started_ns: int


_LEASE_RE = re.compile(r"(?P<host>[^~/]+)~(?P<pid>[0-9]+)~(?P<started>[0-9]+)\.json")


def lease_dir(digest_dir: str) -> str:
    return f"{digest_dir}/{LEASES_DIRNAME}"


def lease_file_name(host: str, pid: int, started_ns: int) -> str:
    return f"{host}~{pid}~{started_ns}{LEASE_SUFFIX}"


def parse_lease_file_name(name: str) -> LeaseName | None:
    match = _LEASE_RE.fullmatch(name)
    if match is None:
        return None
    return LeaseName(match["host"], int(match["pid"]), int(match["started"]))


def is_lease_name(name: str) -> bool:
    """What a walk of ``leases/`` counts as a lease (gc's activity ignores it):
    any visible JSON file. Whose lease it is, ``parse_lease_file_name`` says."""
    return name.endswith(LEASE_SUFFIX) and not name.startswith(".")


# -- gc's own names in the root ----------------------------------------------------


def trash_path(root: str, digest: str, rank: int | None, pid: int, ns: int) -> str:
    """A hidden name gc renames a digest's directory to before deleting it.
    Short (the model name is left out: NAME_MAX) and never a digest name."""
    part = "" if rank is None else f"_r{rank}"
    return f"{root}/{TRASH_PREFIX}{digest}{part}~{pid}~{ns}"


# An NFS client that unlinks or renames over a file it still has open renames
# it to ".nfs<hex>" instead (Linux: 16 hex digits of file id + 8 of a counter)
# and removes it at the last close. Other clients list it; deleting it makes
# its holder's reads fail with ESTALE (v3). Nobody but its client may remove
# it, and it says nothing about use.
_SILLY_RENAME_RE = re.compile(r"\.nfs[0-9A-Fa-f]{8,}")


def is_silly_rename_name(name: str) -> bool:
    """An NFS client's ``.nfs<hex>`` stand-in for an unlinked file still open."""
    return _SILLY_RENAME_RE.fullmatch(name) is not None


def is_trash_name(name: str) -> bool:
    """Any name with gc's trash prefix: what follows it only keeps names unique."""
    return name.startswith(TRASH_PREFIX)


def gc_lock_path(root: str) -> str:
    return f"{root}/{GC_LOCK_NAME}"
