"""NUMA topology discovery and I/O-thread CPU pinning for the filesystem tier.

Threading rule: :func:`read_topology` and :func:`plan_pinning` run once, at
tier start-up, on the caller's thread. They only read sysfs and make one
short ``move_pages`` query, and they never change any thread's affinity.
Each I/O thread then calls :func:`pin_current_thread` on itself when it
starts. On Linux, ``sched_setaffinity(0, ...)`` applies to the calling thread
only, so pinning from any other thread would pin the wrong one.

Only the stdlib is used, so importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import platform
import re
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger("vllm.llmkv_fs.numa")

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_NODE_DIR_RE = re.compile(r"^node(\d+)$")
# move_pages(2) has no glibc wrapper we can rely on (it is in libnuma), so we
# call it through syscall(2); the numbers are per architecture.
_MOVE_PAGES_NR = {"x86_64": 279, "amd64": 279, "aarch64": 239, "arm64": 239}


@dataclass(frozen=True)
class NumaTopology:
    nodes: dict[int, frozenset[int]]
    allowed_cpus: frozenset[int]

    def cpus_for_node(self, node: int) -> frozenset[int]:
        return self.nodes.get(node, frozenset()) & self.allowed_cpus

    @property
    def is_multi_node(self) -> bool:
        # Memory-only nodes (CXL, HBM) have no CPUs to pin to, so they don't
        # make a machine "multi-node" for our purposes.
        return sum(1 for cpus in self.nodes.values() if cpus) > 1


def parse_cpulist(text: str) -> frozenset[int]:
    text = text.strip()
    if not text:
        return frozenset()
    cpus: set[int] = set()
    for part in text.split(","):
        m = _RANGE_RE.match(part.strip())
        if m is None:
            raise ValueError(f"invalid cpulist {text!r}: bad element {part!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"invalid cpulist {text!r}: descending range {part!r}")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    ordered = sorted(set(cpus))
    if ordered and ordered[0] < 0:
        raise ValueError(f"negative CPU id {ordered[0]}")
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def _read_cpulist(path: str) -> frozenset[int] | None:
    """Return the parsed file, or None if it is missing or unreadable.

    Pinning is only an optimisation: odd sysfs contents should make us skip
    it, not stop the tier from starting.
    """
    try:
        with open(path, encoding="ascii") as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError) as e:
        if not isinstance(e, FileNotFoundError):
            logger.debug("cannot read cpulist %s: %s", path, e)
        return None


def _effective_allowed_cpus(cgroup_root: str) -> frozenset[int]:
    allowed = frozenset(os.sched_getaffinity(0))
    # A cgroup v2 cpuset can be narrower than the affinity mask we inherited
    # (e.g. the mask was set before the container's cpuset was tightened).
    cg = _read_cpulist(os.path.join(cgroup_root, "cpuset.cpus.effective"))
    if cg:
        allowed &= cg
    return allowed


def read_topology(
    sysfs_root: str = "/sys",
    allowed_cpus: Iterable[int] | None = None,
    cgroup_root: str = "/sys/fs/cgroup",
) -> NumaTopology:
    allowed = (
        _effective_allowed_cpus(cgroup_root) if allowed_cpus is None else frozenset(allowed_cpus)
    )
    online = _read_cpulist(os.path.join(sysfs_root, "devices/system/cpu/online"))

    node_root = os.path.join(sysfs_root, "devices/system/node")
    nodes: dict[int, frozenset[int]] = {}
    try:
        entries = os.listdir(node_root)
    except OSError:
        entries = []
    for name in entries:
        m = _NODE_DIR_RE.match(name)
        if m is None or not os.path.isdir(os.path.join(node_root, name)):
            continue
        cpus = _read_cpulist(os.path.join(node_root, name, "cpulist")) or frozenset()
        # node<N>/cpulist still lists hot-unplugged CPUs on some kernels.
        nodes[int(m.group(1))] = cpus & online if online is not None else cpus

    if not nodes:
        # Non-NUMA kernel (CONFIG_NUMA=n): everything lives on node 0.
        nodes = {0: online if online is not None else allowed}
    return NumaTopology(nodes=nodes, allowed_cpus=allowed)


def _move_pages_query(address: int) -> int | None:
    nr = _MOVE_PAGES_NR.get(platform.machine().lower())
    if nr is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    page = address & ~(mmap.PAGESIZE - 1)
    pages = (ctypes.c_void_p * 1)(page)
    status = (ctypes.c_int * 1)(-1)
    libc.syscall.restype = ctypes.c_long
    # nodes=NULL turns move_pages into a pure query: status[i] receives the
    # node of page i (or -errno) and nothing is migrated.
    rc = libc.syscall(
        ctypes.c_long(nr),
        ctypes.c_long(0),  # pid 0: this process
        ctypes.c_ulong(1),
        pages,
        None,
        status,
        ctypes.c_int(0),
    )
    if rc != 0:
        logger.debug("move_pages failed: errno %d", ctypes.get_errno())
        return None
    return status[0] if status[0] >= 0 else None


def node_of_address(address: int) -> int | None:
    try:
        return _move_pages_query(address)
    except Exception as e:  # ctypes/platform oddities must never break start-up
        logger.debug("node_of_address(%#x) failed: %s", address, e)
        return None


def node_of_buffer(buf: object, samples: int = 8) -> int | None:
    try:
        view = memoryview(buf).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None  # no buffer protocol, or not C-contiguous
    try:
        n = view.nbytes
        if n == 0 or view.readonly:
            # ctypes can only take the address of writable buffers.
            return None
        arr = (ctypes.c_char * n).from_buffer(view)
        base = ctypes.addressof(arr)
        # Drop the ctypes export right away so the caller can still close or
        # resize the underlying object (mmap.close() fails while exported).
        del arr
    finally:
        view.release()

    samples = max(1, samples)
    offsets = [0] if samples == 1 else [(n - 1) * i // (samples - 1) for i in range(samples)]
    page_addrs = sorted({(base + off) & ~(mmap.PAGESIZE - 1) for off in offsets})
    counts = collections.Counter(
        node for node in (node_of_address(a) for a in page_addrs) if node is not None
    )
    if not counts:
        return None
    return counts.most_common(1)[0][0]


@dataclass(frozen=True)
class PinningPlan:
    node: int | None
    cpus: frozenset[int] | None
    reason: str


def _no_pin(reason: str) -> PinningPlan:
    return PinningPlan(node=None, cpus=None, reason=reason)


def plan_pinning(
    topology: NumaTopology, setting: str | int | None, buffer: object = None
) -> PinningPlan:
    if setting is None or setting == "off":
        return _no_pin("NUMA pinning disabled")
    if isinstance(setting, str) and setting.strip().isdigit():
        setting = int(setting)  # config/env values arrive as strings

    if setting == "auto":
        if not topology.is_multi_node:
            return _no_pin("single NUMA node: not pinning")
        if buffer is None:
            return _no_pin("no primary buffer to locate: not pinning")
        node = node_of_buffer(buffer)
        if node is None:
            return _no_pin("NUMA node of the primary buffer unknown: not pinning")
        cpus = topology.cpus_for_node(node)
        if not cpus:
            return _no_pin(
                f"node {node} holding the primary buffer has no allowed CPUs: not pinning"
            )
        return PinningPlan(
            node,
            cpus,
            f"pinned to node {node} (cpus {format_cpulist(cpus)}) holding the primary buffer",
        )

    if isinstance(setting, int) and not isinstance(setting, bool):
        if setting not in topology.nodes:
            valid = ", ".join(str(n) for n in sorted(topology.nodes))
            raise ValueError(
                f"numa_node={setting} is not a NUMA node of this machine (valid node ids: {valid})"
            )
        cpus = topology.cpus_for_node(setting)
        if not cpus:
            return _no_pin(f"numa_node={setting} override has no allowed CPUs: not pinning")
        return PinningPlan(
            setting,
            cpus,
            f"pinned to node {setting} (cpus {format_cpulist(cpus)}) by numa_node override",
        )

    raise ValueError(f"invalid NUMA setting {setting!r}: expected 'auto', 'off', None or a node id")


def pin_current_thread(cpus: frozenset[int] | None) -> bool:
    if cpus is None:
        return False
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError, OverflowError) as e:  # bad ids raise ValueError
        logger.debug("sched_setaffinity(%s) failed: %s", format_cpulist(cpus), e)
        return False
    return True
