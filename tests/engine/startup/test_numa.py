import mmap
import os
import threading

import pytest

from llmkv_fs.engine.startup import numa
from llmkv_fs.engine.startup.numa import (
    NumaTopology,
    PinningPlan,
    format_cpulist,
    node_of_address,
    node_of_buffer,
    parse_cpulist,
    pin_current_thread,
    plan_pinning,
    read_topology,
)

NODE_ROOT = "/sys/devices/system/node"
ONLINE = "/sys/devices/system/cpu/online"
CGROUP_EFFECTIVE = "/sys/fs/cgroup/cpuset.cpus.effective"


def make_sysfs(fs, nodes, online=None, cgroup=None):
    for node, cpulist in nodes.items():
        fs.create_file(f"{NODE_ROOT}/node{node}/cpulist", contents=cpulist + "\n")
    if nodes:
        # Non-node entries that sit next to nodeN dirs on a real kernel.
        fs.create_file(f"{NODE_ROOT}/online", contents="0\n")
        fs.create_file(f"{NODE_ROOT}/has_cpu", contents="0\n")
        fs.create_dir(f"{NODE_ROOT}/power")
    if online is not None:
        fs.create_file(ONLINE, contents=online + "\n")
    if cgroup is not None:
        fs.create_file(CGROUP_EFFECTIVE, contents=cgroup + "\n")


ALL16 = frozenset(range(16))


# ---------------------------------------------------------------- cpulists


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}),
        ("", set()),
        ("\n", set()),
        ("5", {5}),
        (" 0-1 , 4 ", {0, 1, 4}),
    ],
)
def test_parse_cpulist(text, expected):
    assert parse_cpulist(text) == frozenset(expected)


@pytest.mark.parametrize("text", ["abc", "1,,2", "3-1", "1-", "-1", "0-3,x", "1.5"])
def test_parse_cpulist_garbage(text):
    with pytest.raises(ValueError):
        parse_cpulist(text)


@pytest.mark.parametrize(
    "cpus, text",
    [
        ({0, 1, 2, 3, 8}, "0-3,8"),
        ({0, 1, 2, 3, 8, 10, 11}, "0-3,8,10-11"),
        (set(), ""),
        ({7}, "7"),
        ({1, 3, 5}, "1,3,5"),
        ({4, 5}, "4-5"),
    ],
)
def test_format_cpulist_round_trip(cpus, text):
    assert format_cpulist(cpus) == text
    assert parse_cpulist(text) == frozenset(cpus)
    assert format_cpulist(parse_cpulist(text)) == text


def test_format_cpulist_rejects_negative():
    with pytest.raises(ValueError):
        format_cpulist([-1, 0])


# ---------------------------------------------------------------- topology


def test_single_node(fs):
    make_sysfs(fs, {0: "0-3"}, online="0-3")
    topo = read_topology(allowed_cpus=range(4))
    assert topo.nodes == {0: frozenset(range(4))}
    assert not topo.is_multi_node
    assert topo.cpus_for_node(0) == frozenset(range(4))


def test_two_nodes(fs):
    make_sysfs(fs, {0: "0-7", 1: "8-15"}, online="0-15")
    topo = read_topology(allowed_cpus=ALL16)
    assert topo.nodes == {0: frozenset(range(8)), 1: frozenset(range(8, 16))}
    assert topo.is_multi_node
    assert topo.cpus_for_node(1) == frozenset(range(8, 16))
    assert topo.cpus_for_node(5) == frozenset()


def test_four_nodes_offline_cpus_and_memory_only_node(fs):
    # Node 1 has CPUs 6-7 hot-unplugged; node 3 is memory-only (CXL/HBM).
    make_sysfs(fs, {0: "0-3", 1: "4-7", 2: "8-11", 3: ""}, online="0-5,8-11")
    topo = read_topology(allowed_cpus=range(12))
    assert topo.nodes == {
        0: frozenset(range(4)),
        1: frozenset({4, 5}),
        2: frozenset(range(8, 12)),
        3: frozenset(),
    }
    assert topo.is_multi_node
    assert topo.cpus_for_node(3) == frozenset()


def test_memory_only_nodes_do_not_make_multi_node():
    topo = NumaTopology(
        nodes={0: frozenset({0, 1}), 1: frozenset()}, allowed_cpus=frozenset({0, 1})
    )
    assert not topo.is_multi_node


def test_explicit_allowed_cpus_restrict_nodes(fs):
    make_sysfs(fs, {0: "0-7", 1: "8-15"}, online="0-15")
    topo = read_topology(allowed_cpus=range(8, 12))
    assert topo.allowed_cpus == frozenset(range(8, 12))
    assert topo.cpus_for_node(0) == frozenset()
    assert topo.cpus_for_node(1) == frozenset(range(8, 12))
    # Node membership itself is not narrowed by the allowed set.
    assert topo.nodes[0] == frozenset(range(8))


def test_cgroup_cpuset_narrows_affinity(fs, monkeypatch):
    make_sysfs(fs, {0: "0-7", 1: "8-15"}, online="0-15", cgroup="8-11")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(ALL16))
    topo = read_topology()
    assert topo.allowed_cpus == frozenset(range(8, 12))
    assert topo.cpus_for_node(0) == frozenset()
    assert topo.cpus_for_node(1) == frozenset(range(8, 12))


@pytest.mark.parametrize("cgroup", [None, ""])
def test_missing_or_empty_cgroup_file_uses_affinity(fs, monkeypatch, cgroup):
    make_sysfs(fs, {0: "0-7", 1: "8-15"}, online="0-15", cgroup=cgroup)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1, 2, 9})
    topo = read_topology()
    assert topo.allowed_cpus == frozenset({1, 2, 9})


def test_no_node_directory(fs):
    make_sysfs(fs, {}, online="0-5")
    topo = read_topology(allowed_cpus=range(4))
    assert topo.nodes == {0: frozenset(range(6))}
    assert not topo.is_multi_node
    assert topo.cpus_for_node(0) == frozenset(range(4))


def test_no_node_directory_and_no_online_file(fs):
    fs.create_dir("/sys/devices/system")
    topo = read_topology(allowed_cpus={2, 3})
    assert topo.nodes == {0: frozenset({2, 3})}


def test_missing_online_file_keeps_node_cpulists(fs):
    make_sysfs(fs, {0: "0-1", 1: "2-3"})
    topo = read_topology(allowed_cpus=range(4))
    assert topo.nodes == {0: frozenset({0, 1}), 1: frozenset({2, 3})}


# ---------------------------------------------------------------- plan_pinning


@pytest.fixture
def two_nodes(fs):
    make_sysfs(fs, {0: "0-7", 1: "8-15"}, online="0-15")
    return read_topology(allowed_cpus=ALL16)


def test_auto_single_node_does_not_pin(fs, monkeypatch):
    make_sysfs(fs, {0: "0-3"}, online="0-3")
    topo = read_topology(allowed_cpus=range(4))
    monkeypatch.setattr(numa, "node_of_buffer", lambda buf: pytest.fail("must not be queried"))
    plan = plan_pinning(topo, "auto", buffer=bytearray(8))
    assert plan == PinningPlan(None, None, plan.reason)
    assert "single NUMA node" in plan.reason


def test_auto_two_nodes_follows_buffer(two_nodes, monkeypatch):
    monkeypatch.setattr(numa, "node_of_buffer", lambda buf: 1)
    plan = plan_pinning(two_nodes, "auto", buffer=bytearray(8))
    assert plan.node == 1
    assert plan.cpus == frozenset(range(8, 16))
    assert "8-15" in plan.reason


def test_auto_unknown_buffer_node_does_not_pin(two_nodes, monkeypatch):
    monkeypatch.setattr(numa, "node_of_buffer", lambda buf: None)
    plan = plan_pinning(two_nodes, "auto", buffer=bytearray(8))
    assert plan.node is None and plan.cpus is None
    assert "not pinning" in plan.reason


def test_auto_without_buffer_does_not_pin(two_nodes):
    plan = plan_pinning(two_nodes, "auto", buffer=None)
    assert plan.cpus is None


def test_auto_buffer_on_node_without_allowed_cpus(fs, monkeypatch):
    make_sysfs(fs, {0: "0-7", 1: "8-15"}, online="0-15")
    topo = read_topology(allowed_cpus=range(8))
    monkeypatch.setattr(numa, "node_of_buffer", lambda buf: 1)
    plan = plan_pinning(topo, "auto", buffer=bytearray(8))
    assert plan.cpus is None and plan.node is None
    assert "no allowed CPUs" in plan.reason


@pytest.mark.parametrize("setting", [0, "0"])
def test_int_override(two_nodes, setting):
    plan = plan_pinning(two_nodes, setting)
    assert plan.node == 0
    assert plan.cpus == frozenset(range(8))
    assert "0-7" in plan.reason


def test_int_override_on_single_node_machine(fs):
    make_sysfs(fs, {0: "0-3"}, online="0-3")
    plan = plan_pinning(read_topology(allowed_cpus=range(4)), 0)
    assert plan.node == 0 and plan.cpus == frozenset(range(4))


def test_override_unknown_node_raises(two_nodes):
    with pytest.raises(ValueError) as ei:
        plan_pinning(two_nodes, 3)
    msg = str(ei.value)
    assert "3" in msg and "0, 1" in msg


def test_override_node_excluded_by_cgroup(fs, monkeypatch):
    make_sysfs(fs, {0: "0-7", 1: "8-15"}, online="0-15", cgroup="8-11")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(ALL16))
    plan = plan_pinning(read_topology(), 0)
    assert plan.node is None and plan.cpus is None
    assert "numa_node=0" in plan.reason and "no allowed CPUs" in plan.reason


@pytest.mark.parametrize("setting", ["off", None])
def test_off(two_nodes, monkeypatch, setting):
    monkeypatch.setattr(numa, "node_of_buffer", lambda buf: 1)
    plan = plan_pinning(two_nodes, setting, buffer=bytearray(8))
    assert plan.node is None and plan.cpus is None


@pytest.mark.parametrize("setting", ["bogus", True, 1.0])
def test_invalid_setting_raises(two_nodes, setting):
    with pytest.raises(ValueError):
        plan_pinning(two_nodes, setting)


# ---------------------------------------------------------------- real memory / threads


def test_node_of_buffer_real_memory():
    if not os.path.isdir("/sys/devices/system/node/node0"):
        pytest.skip("no NUMA sysfs on this machine")
    npages = 4
    m = mmap.mmap(-1, npages * mmap.PAGESIZE)
    try:
        for i in range(npages):
            m[i * mmap.PAGESIZE] = 1  # fault the page in
        base_probe = memoryview(m)
        import ctypes

        arr = (ctypes.c_char * len(m)).from_buffer(base_probe)
        addr = ctypes.addressof(arr)
        del arr
        base_probe.release()
        if node_of_address(addr) is None:
            pytest.skip("move_pages unsupported on this arch/kernel")
        expected = min(
            int(d[4:]) for d in os.listdir("/sys/devices/system/node") if d[4:].isdigit()
        )
        assert node_of_address(addr + mmap.PAGESIZE) == expected == 0
        assert node_of_buffer(m) == 0
        assert node_of_buffer(m, samples=1) == 0
        # node_of_buffer must drop its export so the mmap can still be closed.
    finally:
        m.close()
    assert m.closed


def test_node_of_address_unmapped_is_none():
    # Page 0 is never mapped in a user process: status is -EFAULT.
    assert node_of_address(0) is None


def test_node_of_address_unknown_arch(monkeypatch):
    monkeypatch.setattr(numa.platform, "machine", lambda: "sparc64")
    assert node_of_address(0x1000) is None


def test_node_of_buffer_unsupported_inputs():
    assert node_of_buffer(b"read-only bytes") is None
    assert node_of_buffer(bytearray()) is None
    assert node_of_buffer(object()) is None


def test_node_of_buffer_majority(monkeypatch):
    buf = bytearray(16 * mmap.PAGESIZE)
    calls = []

    def fake(addr):
        calls.append(addr)
        return 1 if len(calls) <= 5 else 0

    monkeypatch.setattr(numa, "node_of_address", fake)
    assert node_of_buffer(buf, samples=8) == 1
    assert len(calls) == 8
    assert all(a % mmap.PAGESIZE == 0 for a in calls)


def test_pin_current_thread_real():
    main_before = os.sched_getaffinity(0)
    target = frozenset({min(main_before)})
    seen = {}

    def worker():
        seen["ok"] = pin_current_thread(target)
        seen["affinity"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["ok"] is True
    assert seen["affinity"] == target
    assert os.sched_getaffinity(0) == main_before


def test_pin_current_thread_none_and_failure():
    before = os.sched_getaffinity(0)
    assert pin_current_thread(None) is False
    assert pin_current_thread(frozenset()) is False
    assert os.sched_getaffinity(0) == before
