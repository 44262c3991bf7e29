"""Reading the sealing keys (``seal_key_files``) from their files, once, at
start-up: a mounted Kubernetes Secret, or any file only its owner and group
can read and only its owner can change.

A key file holds 32 random bytes written as 64 hex digits or as base64
(``openssl rand -base64 32 > key``); surrounding whitespace is ignored.
Anything else -- a missing, unreadable, empty, too short, too long or
malformed file, or one everyone may read -- is a ``TierConfigError`` naming
the setting, the key id and the path, never the file's contents.

Nobody but the tier's user (``os.geteuid()``) and root may be able to
choose the key, as OpenSSH's StrictModes asks of a key: the file must be
owned by one of them and writable by neither its group nor others, and so
must every directory the path is resolved through, up to ``/``, and every
link on the way (a Secret volume's ``key -> ..data/key`` and ``..data ->
..<timestamp>`` are followed, each checked). One exception, unlike OpenSSH:
a directory writable by others with the sticky bit set (``/tmp``; the
tmpfs root of a Secret volume, which kubelet leaves ``1777``) is accepted
when the entry the path takes in it is owned by the tier's user or root,
since nobody else may rename or remove that entry there.

Called on the constructing thread before any I/O thread or worker exists.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from collections.abc import Mapping, Sequence

from llmkv_fs.checks import TierConfigError
from llmkv_fs.layout.sealed import KEY_BYTES, MAX_KEY_ID, Keyring, SealKey

__all__ = ["KEY_FILE_LIMIT", "keyring_from_args", "load_keyring", "read_key_file"]

KEY_FILE_LIMIT = 1024  # a key is 44 or 64 characters; more is not a key file
_MAX_LINKS = 40  # links followed on one path, as the kernel does (ELOOP)
_HEX = frozenset("0123456789abcdefABCDEF")
FILES_SETTING = "seal_key_files"
WRITE_SETTING = "seal_write_key_id"


def _refuse(key_id: int, path: str, why: str, setting: str = FILES_SETTING) -> TierConfigError:
    return TierConfigError(f"llmkv_fs: {setting}: key id {key_id} ({path!r}): {why}")


def _decode(text: bytes) -> bytes | None:
    """The key a file's text spells, hex or base64, or None."""
    text = text.strip()
    if text and len(text) % 2 == 0 and all(chr(c) in _HEX for c in text):
        return bytes.fromhex(text.decode("ascii"))
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _trusted(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _owner_and_mode(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"


def _untrusted_entry(kind: str, where: str, st: os.stat_result) -> str | None:
    """Why the entry ``where`` (``kind``: a directory, a link) is owned by
    someone but the tier's user and root, or None."""
    if not _trusted(st.st_uid):
        return (
            f"has a {kind} {where!r} on its path owned by uid {st.st_uid}, not by the "
            f"tier's user (uid {os.geteuid()}) or root"
        )
    return None


def _unsafe_path(path: str) -> tuple[str | None, os.stat_result | None]:
    """Resolve ``path`` as the kernel does, one name at a time, checking each
    directory looked in and each entry passed (links included). Returns why
    another user could change what the path names (or None) and the lstat
    of the file it names."""
    pending = [name for name in os.path.abspath(path).split("/") if name]
    current = "/"
    looked_in = os.lstat(current)
    if why := _untrusted_entry("directory", current, looked_in):
        return why, None
    hops = 0
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":  # ``current`` is resolved: its parent was checked already
            current = os.path.dirname(current)
            looked_in = os.lstat(current)
            continue
        entry = os.path.join(current, name)
        st = os.lstat(entry)
        link = stat.S_ISLNK(st.st_mode)
        # The file itself is _unsafe_file's, checked on its descriptor.
        kind = "link" if link else "directory" if pending else ""
        if kind and (why := _untrusted_entry(kind, entry, st)):
            return why, None
        if looked_in.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (
            looked_in.st_mode & stat.S_ISVTX and _trusted(st.st_uid)
        ):
            return (
                f"has a directory {current!r} on its path that its group or others may "
                f"write ({_owner_and_mode(looked_in)}); make it writable by its owner only"
            ), None
        if link:
            hops += 1
            if hops > _MAX_LINKS:
                return f"has more than {_MAX_LINKS} links on its path", None
            target = os.readlink(entry)
            pending[:0] = [part for part in target.split("/") if part]
            if target.startswith("/"):
                current, looked_in = "/", os.lstat("/")
            continue
        if not pending:
            return None, st
        if not stat.S_ISDIR(st.st_mode):
            return f"has {entry!r} on its path, not a directory", None
        current, looked_in = entry, st
    return None, looked_in  # the path names a directory


def _unsafe_file(st: os.stat_result) -> str | None:
    """Why the opened key file itself may be read or changed by others."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_mode & stat.S_IROTH:
        return (
            f"is readable by everyone (mode {stat.S_IMODE(st.st_mode):04o}); "
            "make it 0400 or 0440 (a Secret volume's defaultMode)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            "make it 0400 or 0440 (a Secret volume's defaultMode)"
        )
    if not _trusted(st.st_uid):
        return f"is owned by uid {st.st_uid}, not by the tier's user (uid {os.geteuid()}) or root"
    return None


def read_key_file(key_id: int, path: str, setting: str = FILES_SETTING) -> SealKey:
    """The key in ``path`` under ``key_id``; TierConfigError, naming
    ``setting``, says why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise _refuse(key_id, path, f"cannot be read ({exc.strerror or exc})", setting) from None
    try:
        st = os.fstat(fd)
        why = _unsafe_file(st)
        if why is None:
            why, named = _unsafe_path(path)
            if why is None and (
                named is None or (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino)
            ):
                why = "was replaced while being checked"
        if why is not None:
            raise _refuse(key_id, path, why, setting)
        data = os.read(fd, KEY_FILE_LIMIT + 1)
    except OSError as exc:
        raise _refuse(key_id, path, f"cannot be read ({exc.strerror or exc})", setting) from None
    finally:
        os.close(fd)
    if len(data) > KEY_FILE_LIMIT:
        raise _refuse(
            key_id, path, f"is longer than {KEY_FILE_LIMIT} bytes: not a key file", setting
        )
    secret = _decode(data)
    how = f"{KEY_BYTES} random bytes as 64 hex digits or base64 (openssl rand -base64 {KEY_BYTES})"
    if secret is None:
        raise _refuse(key_id, path, f"is neither hex nor base64; it must hold {how}", setting)
    if len(secret) < KEY_BYTES:
        raise _refuse(
            key_id, path, f"is too short ({len(secret)} bytes); it must hold {how}", setting
        )
    if len(secret) > KEY_BYTES:
        raise _refuse(
            key_id, path, f"is too long ({len(secret)} bytes); it must hold {how}", setting
        )
    return SealKey(key_id, secret)


def load_keyring(key_files: Mapping[int, str] | None, write_id: int | None) -> Keyring | None:
    """The keyring of the settings (None: sealing is off). ``key_files``
    maps key ids to files (checked by config.py); ``write_id`` is the key
    new blocks are sealed with, optional when there is one key."""
    if not key_files:
        if write_id is not None:
            raise TierConfigError(f"llmkv_fs: {WRITE_SETTING} is set but {FILES_SETTING} is not")
        return None
    if write_id is None:
        if len(key_files) > 1:
            raise TierConfigError(
                f"llmkv_fs: {WRITE_SETTING} is required with several {FILES_SETTING} "
                f"(ids {sorted(key_files)}): the one new blocks are sealed with"
            )
        (write_id,) = key_files
    if write_id not in key_files:
        raise TierConfigError(
            f"llmkv_fs: {WRITE_SETTING} {write_id} is not among the {FILES_SETTING} ids "
            f"{sorted(key_files)}"
        )
    keys = [read_key_file(key_id, path) for key_id, path in sorted(key_files.items())]
    return Keyring(keys, write_id)


def keyring_from_args(specs: Sequence[str], option: str = "--seal-key-file") -> Keyring | None:
    """The keyring of a command line's ``option`` values, ``[ID=]PATH``
    each (ID 1 when left out), writing with the first (the ops tools only
    read; the demo writes). None when there are none."""
    files: dict[int, str] = {}
    for spec in specs:
        key_id, sep, path = spec.partition("=")
        if not sep:
            key_id, path = "1", spec
        if not key_id.isdigit() or not 1 <= int(key_id) <= MAX_KEY_ID:
            raise TierConfigError(
                f"llmkv_fs: {option} {spec!r}: the key id is not in [1, {MAX_KEY_ID}]"
            )
        if int(key_id) in files:
            raise TierConfigError(f"llmkv_fs: {option}: key id {int(key_id)} given twice")
        files[int(key_id)] = path
    if not files:
        return None
    keys = [read_key_file(key_id, path, option) for key_id, path in files.items()]
    return Keyring(keys, next(iter(files)))
