"""The command-line options every ops tool that announces blocks shares
(``gc``, ``verify --repair``, ``events snapshot``), and the Announcer they
build. A bad value or a missing vLLM stops the tool before it touches the
volume (exit status 2, the option's key named), and so does an ``ipc://``
endpoint whose bind would destroy something (``config.check_bind_paths``).

A one-shot tool that could not deliver every event to every wanted
subscriber says so on stderr and exits ``EXIT_UNDELIVERED`` where it would
have exited 0 (``delivery_status``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmkv_fs.ops.events.config import (
    EventsConfigError,
    EventsTarget,
    check_bind_paths,
    parse_events_config,
)

if TYPE_CHECKING:
    from llmkv_fs.ops.events.announcer import Announcer

__all__ = [
    "EXIT_BAD_EVENTS",
    "EXIT_UNDELIVERED",
    "add_event_arguments",
    "announcer_from_args",
    "delivery_status",
]

EXIT_BAD_EVENTS = 2
EXIT_UNDELIVERED = 3  # the work is done; some of its KV events reached no (or too few) routers


def _target(text: str) -> EventsTarget:
    try:
        return parse_events_config(text)
    except EventsConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_event_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    group = parser.add_argument_group("KV events (vLLM's wire format; needs vLLM installed)")
    group.add_argument(
        "--kv-events-config",
        type=_target,
        action="append",
        default=[],
        metavar="JSON",
        help=f"publish {what} as vLLM's KV events to this publisher, given as vLLM's "
        '--kv-events-config is (e.g. \'{"endpoint": "tcp://indexer:5557", "topic": '
        '"kv@shared@model"}\'; * in the endpoint binds, else connects); repeatable: '
        "every target gets every event",
    )
    group.add_argument(
        "--kv-events-locality",
        choices=("LOCAL", "REMOTE"),
        default=None,
        help="the locality the events carry (the replicas' tier setting `locality`)",
    )


def announcer_from_args(
    tool: str, args: argparse.Namespace, roots: Sequence[str], one_shot: bool
) -> Announcer | None:
    """The Announcer the options ask for, or None; exits with a clear
    message when vLLM is missing or an ``ipc://`` endpoint would destroy
    something (``roots``: the cache roots the tool was given).
    ``one_shot``: the tool sends and exits (waits for its subscribers)."""
    targets = getattr(args, "kv_events_config", None) or []
    if not targets:
        if getattr(args, "kv_events_locality", None):
            message = f"llmkv-fs {tool}: --kv-events-locality needs --kv-events-config"
            print(message, file=sys.stderr)
            raise SystemExit(EXIT_BAD_EVENTS)
        return None
    try:
        check_bind_paths(targets, roots)
    except EventsConfigError as exc:
        print(f"llmkv-fs {tool}: --kv-events-config: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_EVENTS) from None
    from llmkv_fs.ops.events.announcer import Announcer, EventsUnavailable

    try:
        return Announcer(targets, locality=args.kv_events_locality, one_shot=one_shot)
    except EventsUnavailable as exc:
        print(f"llmkv-fs {tool}: --kv-events-config: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_EVENTS) from None


def delivery_status(tool: str, announce: Announcer | None, status: int) -> int:
    """After ``announce.close()``: print why events were not delivered, if
    they were not, and the tool's exit status (EXIT_UNDELIVERED instead of
    0 then; a failing status stays)."""
    if announce is None:
        return status
    troubles = announce.troubles()
    undelivered = announce.counts.get("undelivered", 0)
    if not troubles and not undelivered:
        return status
    print(
        f"llmkv-fs {tool}: KV events: {undelivered:,} of "
        f"{undelivered + announce.counts.get('published', 0):,} not delivered "
        "to every wanted subscriber; a router's index may lack them: "
        f"{'; '.join(troubles) or 'see the events counts'}",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_UNDELIVERED if status == 0 else status
