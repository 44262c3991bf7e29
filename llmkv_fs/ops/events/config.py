"""Where the ops tools send KV events: vLLM's ``--kv-events-config`` JSON,
checked here without vLLM so a bad value is refused before any pass, with
an error naming the key.

The keys are vLLM's own (``KVEventsConfig``): ``endpoint``, ``topic``,
``replay_endpoint``, ``buffer_steps``, ``hwm``, ``max_queue_size``, and
``publisher`` (only ``"zmq"``) and ``enable_kv_cache_events`` (only
``true``) so a replica's JSON can be pasted as it is. Bind or connect
follows vLLM's rule: an endpoint with ``*`` or ``::`` (or ``ipc://``,
``inproc://``) is bound, any other is connected to (the usual choice for
gc: the router's indexer binds, every publisher connects to it).

The queue sizes default lower than vLLM's (which keeps up to 100,000
batches queued and 10,000 for replay): a gc that nobody listens to must
hold a few megabytes, not hundreds.

Two keys are the one-shot tools' own (``events snapshot``, ``verify
--repair``, a gc without ``--watch``: ``oneshot.py``): ``subscribers``, how
many matching subscriptions to wait for before the first event (default 1),
and ``wait_s``, the longest that wait, a send held by a full subscriber and
the flush on exit each may take (default 10 seconds). A long-running gc
(``--watch``) publishes through vLLM's publisher and ignores them.

``check_bind_paths`` refuses an ``ipc://`` endpoint the tool would bind
where binding destroys something: libzmq unlinks the path before it binds,
whatever is there.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import socket
import stat
from collections.abc import Sequence
from typing import Any

__all__ = ["EventsConfigError", "EventsTarget", "check_bind_paths", "parse_events_config"]


class EventsConfigError(ValueError):
    """A KV events setting that cannot be used; the message names the key."""


@dataclasses.dataclass(frozen=True)
class EventsTarget:
    """One publisher: vLLM's ZmqEventPublisher arguments."""

    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    buffer_steps: int = 1_000
    hwm: int = 10_000
    max_queue_size: int = 1_000
    subscribers: int = 1  # one-shot tools: matching subscriptions to wait for
    wait_s: float = 10.0  # one-shot tools: the longest each wait (module doc)

    def publisher_kwargs(self) -> dict[str, Any]:
        """The arguments of vLLM's ZmqEventPublisher."""
        given = dataclasses.asdict(self)
        return {key: given[key] for key in _VLLM_KEYS}


_VLLM_KEYS = ("endpoint", "topic", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size")
_INTS = {
    "buffer_steps": (1, 1_000_000),
    "hwm": (1, 10_000_000),
    "max_queue_size": (1, 1_000_000),
    "subscribers": (0, 1_000),
}
_WAIT_S = (0.0, 3600.0)
_HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})")


def _fail(key: str, value: Any, expected: str) -> EventsConfigError:
    return EventsConfigError(f"kv events config: {key}={value!r} is not {expected}")


def check_endpoint(key: str, value: Any) -> str:
    """A ZMQ endpoint vLLM's publisher can bind or connect: ``tcp://HOST:PORT``
    (HOST ``*``, an IP, ``[IPv6]`` or a host name), ``ipc://PATH`` or
    ``inproc://NAME``."""
    expected = "tcp://HOST:PORT, ipc://PATH or inproc://NAME"
    if not isinstance(value, str) or "\0" in value:
        raise _fail(key, value, expected)
    for scheme in ("ipc://", "inproc://"):
        if value.startswith(scheme):
            if len(value) == len(scheme):
                raise _fail(key, value, f"{expected} (the name is empty)")
            return value
    if not value.startswith("tcp://"):
        raise _fail(key, value, expected)
    host, sep, port = value[len("tcp://") :].rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise _fail(key, value, f"{expected} (PORT a number from 0 to 65535)")
    if host.startswith("[") and host.endswith("]"):
        _ip(key, value, host[1:-1], expected)
    elif host != "*" and not _HOST_RE.fullmatch(host):
        raise _fail(key, value, f"{expected} (HOST *, an IP address or a host name)")
    if int(port) == 0 and host != "*":
        raise _fail(key, value, f"{expected} (port 0 only with HOST *)")
    return value


def _ip(key: str, value: str, text: str, expected: str) -> None:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise _fail(key, value, f"{expected} ([...] must hold an IPv6 address)") from None


def _check_topic(value: Any) -> str:
    if not isinstance(value, str) or "\0" in value or len(value.encode("utf-8")) > 1024:
        raise _fail("topic", value, "a string (up to 1024 bytes, no NUL)")
    return value


def _check_int(key: str, value: Any) -> int:
    low, high = _INTS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(key, value, f"an integer in [{low}, {high}]")
    return value


def _check_wait(value: Any) -> float:
    low, high = _WAIT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _fail("wait_s", value, f"a number of seconds in [{low:g}, {high:g}]")
    return float(value)


def parse_events_config(text: str) -> EventsTarget:
    """``--kv-events-config``'s JSON object, checked key by key."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EventsConfigError(f"kv events config is not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise EventsConfigError("kv events config must be a JSON object")
    fields: dict[str, Any] = {}
    for key, value in given.items():
        if key == "enable_kv_cache_events":
            if value is not True:
                raise _fail(key, value, "true (leave the option out to publish nothing)")
        elif key == "publisher":
            if value != "zmq":
                raise _fail(key, value, '"zmq" (the only publisher the tools have)')
        elif key in ("endpoint", "replay_endpoint"):
            if key == "replay_endpoint" and value is None:
                continue
            fields[key] = check_endpoint(key, value)
        elif key == "topic":
            fields[key] = _check_topic(value)
        elif key in _INTS:
            fields[key] = _check_int(key, value)
        elif key == "wait_s":
            fields[key] = _check_wait(value)
        else:
            known = "enable_kv_cache_events, publisher, endpoint, replay_endpoint, topic, "
            raise EventsConfigError(
                f"kv events config: unknown key {key!r} (known: {known}{', '.join(_INTS)}, wait_s)"
            )
    if "endpoint" not in fields:
        raise EventsConfigError("kv events config: endpoint is required (e.g. tcp://indexer:5557)")
    replay = fields.get("replay_endpoint")
    if replay is not None and not _is_bind(replay):
        raise _fail("replay_endpoint", replay, "an endpoint to bind (tcp://*:PORT, ipc://, ...)")
    return EventsTarget(**fields)


def _is_bind(endpoint: str) -> bool:
    """vLLM's ZmqEventPublisher._is_bind_endpoint, which binds these."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def check_bind_paths(targets: Sequence[EventsTarget], roots: Sequence[str]) -> None:
    """Refuse every ``ipc://`` path a target would bind that binding could
    destroy (libzmq unlinks it first, whatever it is): one inside a cache
    root in ``roots`` (resolved: a block file, a lease), one whose
    directory does not exist, an existing one that is not a socket (an
    operator's file, a symlink), and a socket something is listening on.
    A path that does not exist yet, or a stale socket nobody serves, is
    ours to replace. (Checked, then bound: something put there in between
    is lost; keep the path in a directory only the tool's user writes.)
    An abstract name (``ipc://@name``) has no file."""
    real_roots = [os.path.realpath(root) for root in roots]
    for target in targets:
        bound = (("endpoint", target.endpoint), ("replay_endpoint", target.replay_endpoint))
        for key, endpoint in bound:
            if endpoint is None or not endpoint.startswith("ipc://"):
                continue
            path = endpoint[len("ipc://") :]
            if path.startswith("@"):
                continue
            why = _not_ours_to_bind(path, real_roots)
            if why:
                raise _fail(key, endpoint, f"a path the tool may replace with its socket ({why})")


def _not_ours_to_bind(path: str, real_roots: Sequence[str]) -> str:
    """Why binding ``path`` could destroy something; "" if it cannot."""
    real = os.path.realpath(path)
    for root in real_roots:
        if os.path.commonpath([real, root]) == root:
            return f"{real} is inside the cache root {root}"
    if not os.path.isdir(os.path.dirname(real)):
        return f"its directory {os.path.dirname(real)} does not exist"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"cannot look at it: {exc.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} exists and is not a socket: binding would delete it"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return ""  # a stale socket: nobody listens
    return f"{path} is a socket another process is listening on"
