"""Running as another user in a forked child: the one way the suite drops
root (tests that need a reader or writer of another uid), for the command
line tools (``tool_as``) and for any function (matrix_kit.Forked).

A fork of this already-loaded process rather than a new interpreter: the
interpreter lives where other users may not read it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence


def become(uid: int, gid: int, groups: Sequence[int] = (), umask: int | None = None) -> None:
    """In a forked child: drop to ``uid``/``gid`` with ``groups`` as the
    supplementary groups (root's are dropped first), and ``umask``."""
    os.setgroups(list(groups))
    os.setgid(gid)
    os.setuid(uid)
    if umask is not None:
        os.umask(umask)


def tool_as(
    uid: int,
    gid: int,
    argv: list[str],
    groups: Sequence[int] = (),
    umask: int | None = None,
) -> tuple[int, str, str]:
    """``llmkv-fs <argv>`` in a forked child running as ``uid``/``gid`` (see
    ``become``). (status, stdout, stderr)."""
    from llmkv_fs.cli import main as cli_main

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 70
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (not pytest's capture)
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            become(uid, gid, groups, umask)
            status = cli_main(argv)
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException as exc:  # reported through the pipe
            os.write(2, f"{type(exc).__name__}: {exc}\n".encode())
        finally:
            os._exit(status if isinstance(status, int) else 70)
    os.close(out_w)
    os.close(err_w)
    got: dict[int, list[bytes]] = {out_r: [], err_r: []}

    def drain(fd: int) -> None:
        while chunk := os.read(fd, 65536):
            got[fd].append(chunk)
        os.close(fd)

    reader = threading.Thread(target=drain, args=(err_r,))
    reader.start()
    drain(out_r)
    reader.join()
    _pid, wait_status = os.waitpid(pid, 0)
    out, err = (b"".join(got[fd]).decode(errors="replace") for fd in (out_r, err_r))
    return os.waitstatus_to_exitcode(wait_status), out, err
