"""The volume's state as every block needs it, in one page that the engine
and its worker processes share: whether root_dir is lost, whether stores are
refused (the space guard), and the free space measured at the last ENOSPC.

The page is a memfd mapped by the engine and, through an inherited fd, by
each I/O worker, so the per-block checks (block/blockio.py) read the same
answer in a thread of the engine and in a worker: a worker never stores to a
root the engine has found lost, nor past a space guard it has tripped.

Threading and processes: plain byte and u64 stores and loads, no lock. The
writers are the housekeeping thread (``root_lost``, the space verdict of
each sample) and whichever thread or worker saw ENOSPC (``trip_enospc``).
The one race -- a sample clearing ``refused`` between a worker's two stores
in ``trip_enospc`` -- is settled by the next sample (a second), because the
sample re-reads ``enospc`` right before it writes the verdict.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct

__all__ = ["VolumeSignals"]

# Offsets: root_lost u8, refused u8, enospc u8, then at 8 the free bytes at
# the last ENOSPC (u64).
_ROOT_LOST, _REFUSED, _ENOSPC = 0, 1, 2
_FREE_AT = 8
_UNKNOWN = (1 << 64) - 1  # free space at ENOSPC not measured yet


class VolumeSignals:
    """See the module doc. ``create()`` in the engine; ``attach(fd)`` in a
    worker, with the fd the engine handed over (``fd``)."""

    def __init__(self, fd: int, page: mmap.mmap):
        self.fd = fd
        self._page: mmap.mmap | bytearray = page

    @classmethod
    def create(cls, name: str = "llmkv_fs") -> VolumeSignals:
        fd = os.memfd_create(f"{name}_volume_signals", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, mmap.PAGESIZE)
            return cls(fd, mmap.mmap(fd, mmap.PAGESIZE))
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> VolumeSignals:
        """Map the page behind an inherited fd (a worker: the fd is closed
        once mapped)."""
        page = mmap.mmap(fd, mmap.PAGESIZE)
        os.close(fd)
        return cls(-1, page)

    def close(self) -> None:
        """Release the page: the fd (no worker can map it any more) and the
        mapping, whose ``mmap`` object holds a duplicate of the fd of its
        own. What the page said last stays readable (a copy), since the
        owner may still ask a shut-down engine about the volume; nothing
        may write to it any more. Idempotent."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        page = self._page
        if isinstance(page, mmap.mmap):
            last = bytearray(page)
            try:
                page.close()
            except BufferError:  # a view of it still exported: freed with it
                return
            self._page = last

    # -- root_dir --------------------------------------------------------------

    @property
    def root_lost(self) -> bool:
        return bool(self._page[_ROOT_LOST])

    @root_lost.setter
    def root_lost(self, lost: bool) -> None:
        self._page[_ROOT_LOST] = 1 if lost else 0

    # -- the space guard's state -----------------------------------------------

    @property
    def stores_refused(self) -> bool:
        return bool(self._page[_REFUSED])

    def store_flags(self) -> tuple[int, int]:
        """``root_lost`` and ``stores_refused`` in one read (nonzero: set),
        as a block about to be stored asks them."""
        page = self._page
        return page[_ROOT_LOST], page[_REFUSED]

    @property
    def enospc(self) -> bool:
        return bool(self._page[_ENOSPC])

    @property
    def refusal(self) -> str:
        """Why stores are refused: "ok" (they are not), "ENOSPC" or "watermark"."""
        if not self.stores_refused:
            return "ok"
        return "ENOSPC" if self.enospc else "watermark"

    def trip_enospc(self, free_bytes: int | None) -> None:
        """A write failed with ENOSPC: refuse stores until room is made;
        ``free_bytes`` is what was free right then (None: the next sample
        measures it)."""
        struct.pack_into("<Q", self._page, _FREE_AT, _UNKNOWN if free_bytes is None else free_bytes)
        self._page[_ENOSPC] = 1
        self._page[_REFUSED] = 1

    def free_at_enospc(self) -> int | None:
        (free,) = struct.unpack_from("<Q", self._page, _FREE_AT)
        return None if free == _UNKNOWN else int(free)

    def set_free_at_enospc(self, free_bytes: int) -> None:
        struct.pack_into("<Q", self._page, _FREE_AT, free_bytes)

    def clear_enospc(self) -> None:
        self._page[_ENOSPC] = 0

    def set_refused(self, over_watermark: bool) -> None:
        """The sample's verdict: refused if over a watermark or since an
        ENOSPC not yet cleared (re-read here, see the module doc)."""
        self._page[_REFUSED] = 1 if over_watermark or self._page[_ENOSPC] else 0
