"""``python -m tools.gluster up|delay|down``: a loopback GlusterFS volume from a
shell (root), for benchmarks run by hand; the volume stays up until ``down``.
The volume is tools/gluster/loopback.py's, the delay tools/gluster/delay.py's."""

from __future__ import annotations

import argparse
import sys

from tools.gluster import delay
from tools.gluster.glusterd import Unavailable
from tools.gluster.loopback import BENCH_PREFIX, MANUAL_OWNER, bring_up, down, find


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.gluster",
        description="A one-brick GlusterFS volume on loopback, mounted twice (root).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    s_up = sub.add_parser("up", help="create, start and mount a volume; prints NAME A B")
    s_up.add_argument("--prefix", default=BENCH_PREFIX)
    s_delay = sub.add_parser("delay", help="set (US > 0) or clear (0) the server-side delay")
    s_delay.add_argument("name")
    s_delay.add_argument("us", type=int, help="microseconds per file operation")
    s_delay.add_argument("--server-threads", type=int, help="brick I/O threads (1..64)")
    s_delay.add_argument("--fops", help=f"comma list (default: {','.join(delay.DELAY_FOPS)})")
    s_down = sub.add_parser("down", help="unmount, stop and delete a volume")
    s_down.add_argument("name")
    return p


def _delay_command(args: argparse.Namespace) -> None:
    vol = find(args.name)
    fops = args.fops.split(",") if args.fops else delay.DELAY_FOPS
    took = delay.set_delay(vol, args.us, fops, args.server_threads)
    p50 = delay.negative_stat_p50(delay.probe_dir(vol))
    print(
        f"{vol.volume}: delay {args.us} µs (restart {took:.1f} s); "
        f"negative stat p50 from mount B {p50 * 1e3:.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "up":
            vol = bring_up(args.prefix, owner=MANUAL_OWNER)
            print(vol.volume, vol.mount_a, vol.mount_b)
        elif args.command == "delay":
            _delay_command(args)
        else:
            down(find(args.name))
    except Unavailable as exc:
        print(f"unavailable: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
