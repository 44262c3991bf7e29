"""The command-line options every ops tool that announces blocks shares
(``gc``, ``verify --repair``, ``events snapshot``), and the Announcer they
build. A bad value or a missing vLLM stops the tool before it touches the
volume (exit status 2, the option's key named)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from llmkv_fs.ops.events.config import EventsConfigError, EventsTarget, parse_events_config

if TYPE_CHECKING:
    from llmkv_fs.ops.events.announcer import Announcer

__all__ = ["EXIT_BAD_EVENTS", "add_event_arguments", "announcer_from_args"]

EXIT_BAD_EVENTS = 2


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


def announcer_from_args(tool: str, args: argparse.Namespace) -> Announcer | None:
    """The Announcer the options ask for, or None; exits with a clear
    message when vLLM is missing."""
    targets = getattr(args, "kv_events_config", None) or []
    if not targets:
        if getattr(args, "kv_events_locality", None):
            message = f"llmkv-fs {tool}: --kv-events-locality needs --kv-events-config"
            print(message, file=sys.stderr)
            raise SystemExit(EXIT_BAD_EVENTS)
        return None
    from llmkv_fs.ops.events.announcer import Announcer, EventsUnavailable

    try:
        return Announcer(targets, locality=args.kv_events_locality)
    except EventsUnavailable as exc:
        print(f"llmkv-fs {tool}: --kv-events-config: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_EVENTS) from None
