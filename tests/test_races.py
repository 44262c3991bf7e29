"""The house rule that a loaded machine must never fail a test, checked
against every test module and kit (tests/**.py) by reading its syntax tree.

Three patterns race the machine:

- **wall clock in an assertion**: an ``assert`` that reads ``time.monotonic()``,
  ``time.time()``, ``time.perf_counter()`` (or their ``_ns`` forms), or a name
  the same function assigned from an expression that reads them
  (``elapsed = time.monotonic() - t0; assert elapsed < 2``): a slow machine
  stretches every duration;
- **a wait on one value, an assertion on another**: a polling helper's call
  (``wait_until(lambda: P, ...)``, ``wait_jobs``, ``lookup_until``, ...: every
  function of tests/ that sleeps in a loop) followed at once by ``assert Q``
  where ``Q`` shares no attribute name, subscript key, called name or string
  constant with the wait: the asserted state may not have arrived yet;
- **a sleep as synchronization**: ``time.sleep(...)`` outside a polling loop
  (a ``while``/``for`` that checks a condition): it waits for a time, not for
  the state;
- **a count of the whole process**: its descriptors or threads counted
  unfiltered (``open_fds(os.getpid())``, ``set(os.listdir("/proc/self/fd"))``,
  ``threading.active_count()``, ``len(threading.enumerate())``,
  ``psutil.Process().num_fds()``): a thread another test left winding down, or
  a library's, opens and closes what it likes meanwhile. Count a child that
  holds still, or only what the test made (a loop over the listing that
  filters by target or name is not a count of the whole).

docs/testing.md states the rules. Each kept exception is in ``ALLOWED``,
``"path::function": "why it is safe"``; a finding not there fails the test
with its file and line, and an entry that matches nothing fails too.
"""

from __future__ import annotations

import ast
import builtins
import itertools
from dataclasses import dataclass

import pytest

from tests.kits import REPO, TESTS

CLOCKS = frozenset(
    ("monotonic", "time", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns")
)
# Calls whose result is still a clock reading when an argument is one.
ARITHMETIC = frozenset(("abs", "max", "min", "round", "int", "float", "sum", "approx"))
# Called names too common to tie a wait to an assertion.
BUILTINS = frozenset(dir(builtins))
# Names of the things under test, passed to nearly every helper.
BARE = frozenset(("engine", "replica", "a", "b", "primary", "gate", "self"))
# Polling helpers not defined in tests/ (none today); the rest are found.
EXTRA_POLLERS: frozenset[str] = frozenset()

# "path::function" -> why the finding is safe. Every entry must match a finding.
ALLOWED: dict[str, str] = {
    "tests/ops/test_doctor.py::test_the_same_replicas_alike_share": (
        "cli.main runs doctor to its end in the test's own thread (no polling): its "
        "output is complete when it returns"
    ),
    "tests/tier/test_metrics_alerts.py::"
    "test_lookups_missing_sealed_blocks_of_another_key_fire_miss_for_a_reason": (
        "settle() returns when the tier has no pending work: the lookup counters the "
        "alert's expression reads are final then, and the scrape reads them"
    ),
    "tests/tier/test_miss_reasons.py::"
    "test_a_check_held_past_the_deadline_misses_stalled_then_deadline": (
        "the held key's verdict was decided by the deadline before the wait (a late "
        "answer is never taken); the wait only lifts the stalled refusal, and find() "
        "polls the lookup until it resolves"
    ),
    "tests/engine/scheduling/test_deadlines.py::"
    "test_stuck_store_fails_at_deadline_and_is_never_published": (
        "the submit after the gate is an action (the queue has room), not a read; "
        "recheck_stalled() is False only when the scheduler's stuck_blocks count is 0, "
        "the count the gauge shows"
    ),
    "tests/engine/scheduling/test_deadlines.py::"
    "test_a_slice_of_an_expired_store_runs_none_of_its_later_blocks": (
        "held_blocks is 0 only once every held slice was given back, after each of its "
        "blocks ran: a block writes its gate marker, and removes its temp file, before "
        "its slice is given back"
    ),
    "tests/engine/scheduling/test_deadlines.py::"
    "test_stuck_load_is_reported_only_when_its_reads_return": (
        "early collects every job taken while waiting; a held read keeps recheck_stalled() "
        "True (stuck_blocks > 0 is its definition) and the gate holds the other block still"
    ),
    "tests/engine/scheduling/test_deadlines.py::"
    "test_overdue_lookups_miss_and_a_late_answer_keeps_the_failed_load_verdict": (
        "the wait ends once the late answer was taken in (end_step); the verdict asserted "
        "is the one the engine keeps from then on"
    ),
    "tests/engine/scheduling/test_deadlines.py::"
    "test_stuck_store_through_vllm_fails_cleanly_and_reset_completes": (
        "the gate is opened only by this test (the assert says so); recovered() is the "
        "held writes returning, after which no published file can appear (they were "
        "cancelled) and the temp files were removed by the blocks themselves"
    ),
    "tests/engine/scheduling/test_io_priority.py::"
    "test_io_workers_nice_lowers_worker_processes_and_spares_io_threads": (
        "the engine's own priority is set once at start-up, never by the workers: "
        "nothing can move it while the test waits"
    ),
    "tests/engine/test_access_and_modes.py::test_load_stamps_access_once_per_interval": (
        "stamps land in load order on one thread: once the later load's file is stamped, "
        "an earlier one's stamp would have landed; the assertions are that none did"
    ),
    "tests/engine/test_access_and_modes.py::test_stamp_is_renewed_after_the_interval": (
        "stamps land in load order: the later file's stamp shows the earlier one was "
        "decided (not stamped, the fake clock is before the interval)"
    ),
    "tests/engine/test_lookup.py::test_checks_go_parallel_once_the_volume_makes_them_wait.exists": (
        "time.sleep(0) gives up the GIL in a fake volume check, as a real one does; "
        "the time is the fake ThreadClock's"
    ),
    "tests/engine/test_lookup.py::"
    "test_a_chunk_checked_at_once_is_timed_whole_and_a_failure_checked_key_by_key.exist_many": (
        "time.sleep(0) gives up the GIL in a fake volume check; the time is the fake ThreadClock's"
    ),
    "tests/engine/upkeep/test_space.py::"
    "test_engine_resumes_stores_when_room_is_made_right_after_enospc": (
        "the store is an action: submit_store asks the very guard tripped() read, and "
        "nothing trips it again (the volume was emptied)"
    ),
    "tests/engine/upkeep/test_space.py::"
    "test_engine_resumes_after_one_gc_pass_with_its_default_band": (
        "the store is an action: submit_store asks the very guard tripped() read, and "
        "nothing trips it again (no watermark, nothing written until this store)"
    ),
    "tests/engine/upkeep/test_space.py::"
    "test_watermark_drops_stores_loads_continue_and_gc_lifts_it": (
        "the store is an action: submit_store asks the very guard tripped() read, and "
        "nothing fills the volume again"
    ),
    "tests/engine/upkeep/test_space.py::"
    "test_queued_stores_are_dropped_when_the_guard_trips_under_them": (
        "the submit is an action while the volume is not full yet (the filler is written after it)"
    ),
    "tests/engine/workers/test_workers.py::test_a_store_past_its_deadline_is_never_published": (
        "in_flight == 0 means no block is inside a worker: stuck_blocks, which "
        "recheck_stalled() reads, counts those blocks"
    ),
    "tests/engine/workers/test_workers.py::"
    "test_a_load_past_its_deadline_waits_for_its_held_blocks": (
        "the workers are stopped (SIGSTOP) until _resume: the held blocks keep the job pending"
    ),
    "tests/engine/workers/test_workers.py::"
    "test_a_replacement_that_dies_at_start_up_is_counted_and_backs_off": (
        "the store after the crew is whole again is an action that waits for its own jobs"
    ),
    "tests/engine/workers/test_workers.py::test_a_workers_death_does_not_make_good_blocks_miss": (
        "settle() polls each lookup until it has a verdict: the assertion waits on its own value"
    ),
    "tests/layout/test_blockfile.py::test_store_writes_payload_then_trailer": (
        "brackets a stamp between two readings of the same clock, no duration: a slow "
        "machine only widens the bracket"
    ),
    "tests/volume/test_leases.py::test_lease_lifecycle": (
        "brackets the lease's start stamp between two readings of the same clock, no "
        "duration: a slow machine only widens the bracket"
    ),
    "tests/volume/test_leases.py::test_short_lease_interval_is_refreshed_before_it_looks_dead": (
        "the timeouts are those the thread asked its wake event for (its schedule), "
        "recorded before each wait; rounds ran, so the list is not empty"
    ),
    "tests/volume/test_pinned_root.py::"
    "test_a_load_that_meets_a_replaced_root_is_a_lost_root_not_a_bad_file": (
        "remembered misses are dropped when the root is found back, in the same "
        "recheck that clears the gauge waited on"
    ),
    "tests/volume/test_pinned_root.py::test_unmount_while_running_fails_the_volume_and_recovers": (
        "asserts an absence (nothing created under the mount point): a late write could "
        "only be missed, never make it fail; a lost root's housekeeping takes no usage "
        "sample, so no round count exists to wait on"
    ),
    "tests/system/test_cross_client.py::"
    "test_silly_renamed_files_are_never_removed_counted_or_taken_for_use": (
        "gc runs in this process after the wait: its exit status is the action's result"
    ),
    "tests/system/test_matrix_crash.py::test_sigkill_mid_write_never_publishes_a_torn_file": (
        "a random instant for the kill, not a synchronization: the held block keeps the "
        "writer storing until the kill, whenever it lands"
    ),
    "tests/system/test_untrusted_volume.py::test_housekeeping_survives_any_exception": (
        "errors only grows and was waited to 3 just before; a thread that died stays dead"
    ),
    "tests/tier/test_metrics_alerts.py::test_an_idle_tier_fires_no_alert": (
        "settle() steps until nothing is in flight; the scrape reads the gauges on this "
        "thread at once (take_stats), with nothing left to change them"
    ),
    "tests/tier/test_metrics_alerts.py::test_an_unmounted_volume_fires_volume_failed": (
        "the scrape reads root.lost itself (engine.gauges' volume_failed), the state waited on"
    ),
    "tests/tier/test_metrics_alerts.py::test_a_full_volume_fires_space_guard_tripped": (
        "the scrape reads guard.allows_store() itself (space_guard_tripped), the state waited on"
    ),
    "tests/tier/test_metrics_alerts.py::test_a_flipped_bit_fires_corrupt_blocks": (
        "settle() steps until the load finished; a block's corrupt count travels with "
        "its result, which the finished job carries"
    ),
    "tests/tier/test_removals.py::test_a_stalled_volume_s_refusals_announce_nothing": (
        "resolve() steps until each lookup has a verdict; the stall holds (the gate keeps "
        "the block inside the volume)"
    ),
    "tests/tier/test_removals.py::_lost_and_back": (
        "resolve() steps until each lookup has a verdict; the root's state waited on is "
        "changed only by this test"
    ),
}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    function: str
    kind: str  # "clock", "wait", "sleep", "process"
    detail: str

    @property
    def key(self) -> str:
        return f"{self.path}::{self.function}"

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.function}: {self.kind}: {self.detail}"


def _is_clock_call(node: ast.AST) -> bool:
    """``time.monotonic()`` and friends, or a bare ``monotonic()`` imported from time."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in CLOCKS and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id in CLOCKS - {"time"}


def _is_sleep(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr == "sleep" and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id == "sleep"


def _is_own_pid(node: ast.AST) -> bool:
    """``os.getpid()``, or the string ``"/proc/self/fd"`` (an f-string too)."""
    if isinstance(node, ast.Call):
        return _call_name(node) == "getpid"
    if isinstance(node, ast.Constant):
        return node.value == "/proc/self/fd"
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        return text.startswith("/proc/self/fd") or (
            any(_is_own_pid(v.value) for v in node.values if isinstance(v, ast.FormattedValue))
            and text.endswith("/fd")
        )
    return False


def _process_counts(function: ast.AST):
    """The calls of ``function`` that count the whole process's descriptors or
    threads; a listing iterated by a ``for`` or a comprehension is filtered,
    not counted."""
    iterated = set()
    for node in _own_nodes(function):
        if isinstance(node, (ast.For, ast.comprehension)):
            iterated.add(id(node.iter))
    for node in _own_nodes(function):
        if isinstance(node, ast.Call) and _counts_whole_process(node, iterated):
            yield node


def _counts_whole_process(call: ast.Call, iterated: set[int]) -> bool:
    name, args, func = _call_name(call), call.args, call.func
    own_process = (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Call)
        and _call_name(func.value) == "Process"
        and not func.value.args
    )
    return (
        name == "active_count"
        or (name in ("num_fds", "num_threads") and own_process)
        or (name == "open_fds" and bool(args) and _is_own_pid(args[0]))
        or (
            name == "len"
            and bool(args)
            and isinstance(args[0], ast.Call)
            and _call_name(args[0]) == "enumerate"
            and not args[0].args
        )
        or (name == "listdir" and bool(args) and _is_own_pid(args[0]) and id(call) not in iterated)
    )


def _own_nodes(function: ast.AST):
    """The nodes of ``function``'s body, not those of functions (or lambdas)
    defined inside it: those are scanned as functions of their own."""
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _functions(tree: ast.AST):
    """(qualified name, node) of every function and method, nested ones too."""

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _clock_names(function: ast.AST) -> set[str]:
    """Names assigned, in this function, from an expression that reads the
    wall clock or another such name (to a fixed point: ``t0``, then
    ``elapsed = time.monotonic() - t0``)."""
    assigns = []
    for node in _own_nodes(function):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            assigns.append((names, node.value))
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for names, value in assigns:
            if names <= tainted:
                continue
            if _reads_clock(value, tainted):
                tainted |= names
                changed = True
    return tainted


def _reads_clock(expr: ast.AST, tainted: set[str]) -> bool:
    """Whether ``expr`` computes with a clock reading. A call's arguments do
    not count (``trash_path(root, time.time_ns())`` is a name, and
    ``pid_alive(pid, started_by_ns=time.time_ns())`` compares inside the
    product, against a fixed moment), except arithmetic helpers'
    (``abs``, ``max``, ``pytest.approx``)."""
    todo = [expr]
    while todo:
        node = todo.pop()
        if _is_clock_call(node):
            return True
        if isinstance(node, ast.Name) and node.id in tainted:
            return True
        if isinstance(node, ast.Call) and _call_name(node) not in ARITHMETIC:
            continue
        todo.extend(ast.iter_child_nodes(node))
    return False


def _tokens(expr: ast.AST, names: bool = True) -> set[str]:
    """What ties an expression to a state: attribute names, subscript keys,
    called names (not builtins), string constants and names used as values
    (``len(pauses)``); a name whose attribute is read, or one of ``BARE``,
    does not (``engine``, ``a``, ``replica`` name a thing, not its state)."""
    out: set[str] = set()
    bases = {id(n.value) for n in ast.walk(expr) if isinstance(n, ast.Attribute)}
    bases |= {id(n.func) for n in ast.walk(expr) if isinstance(n, ast.Call)}
    for node in ast.walk(expr):
        if isinstance(node, ast.Name):
            if names and id(node) not in bases and node.id not in BARE:
                out.add(node.id)  # a value itself (``len(pauses)``), not a thing's name
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Subscript):
            key = node.slice
            if isinstance(key, ast.Constant):
                out.add(repr(key.value))
            elif isinstance(key, ast.Name):
                out.add(f"[{key.id}]")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id not in BUILTINS:
                out.add(node.func.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(repr(node.value))
    return out


def _call_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _is_polling_loop(loop: ast.AST) -> bool:
    """A loop that checks a condition: ``while <test>`` (not a constant), or
    any loop with an ``if`` that leaves it (break, return, raise, a fail)."""
    if isinstance(loop, ast.While) and not isinstance(loop.test, ast.Constant):
        return True
    for node in ast.walk(loop):
        if isinstance(node, ast.If):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Break, ast.Return, ast.Raise)):
                    return True
                if isinstance(inner, ast.Call) and _call_name(inner) == "fail":
                    return True
    return False


def _walk_polling(function: ast.AST):
    """(node, inside a polling loop) for this function's own nodes."""

    def visit(node, in_poll):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            yield child, in_poll
            poll = in_poll or (
                isinstance(child, (ast.While, ast.For, ast.AsyncFor)) and _is_polling_loop(child)
            )
            yield from visit(child, poll)

    yield from visit(function, False)


def pollers(trees: list[ast.AST]) -> frozenset[str]:
    """The polling helpers: every function of these trees that sleeps inside
    a polling loop (wait_until, wait_jobs, lookup_until, ...)."""
    found = set(EXTRA_POLLERS)
    functions = [(name.rsplit(".", 1)[-1], f) for tree in trees for name, f in _functions(tree)]
    for name, function in functions:
        for node in _own_nodes(function):
            loop = isinstance(node, (ast.While, ast.For)) and _is_polling_loop(node)
            if loop and any(_is_sleep(n) for n in ast.walk(node)):
                found.add(name)
                break
    # A function that returns after a poller's call polls too (lookup_until).
    grown = True
    while grown:
        grown = False
        for name, function in functions:
            named = name.startswith(("wait", "settle")) or "until" in name
            if (
                named
                and name not in found
                and any(
                    isinstance(n, ast.Call) and _call_name(n) in found for n in _own_nodes(function)
                )
            ):
                found.add(name)
                grown = True
    return frozenset(found)


def _wait_call(stmt: ast.stmt, waiters: frozenset[str]) -> tuple[ast.Call, set[str]] | None:
    """If ``stmt`` is a call of a polling helper (as a statement or assigned):
    the call and the names it assigns."""
    targets: set[str] = set()
    value = None
    if isinstance(stmt, ast.Expr):
        value = stmt.value
    elif isinstance(stmt, ast.Assign):
        value = stmt.value
        targets = {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(value, ast.Call) and _call_name(value) in waiters:
        return value, targets
    return None


def _waited_tokens(call: ast.Call, helpers: dict[str, ast.AST]) -> set[str]:
    """What the wait waits on: a lambda's body, else every argument; a
    function of the module named there adds what its own body reads."""
    lambdas = [a for a in call.args if isinstance(a, ast.Lambda)]
    waited = [a.body for a in lambdas] or [
        *call.args,
        *(k.value for k in call.keywords),
    ]
    if isinstance(call.func, ast.Attribute):
        waited.append(call.func.value)  # replica.settle(): the replica's state
    out: set[str] = set()
    for expr in waited:
        out |= _tokens(expr)
        for node in ast.walk(expr):
            if isinstance(node, ast.Name) and node.id in helpers:
                out |= _tokens(helpers[node.id])  # a predicate: its own names count
    name = _call_name(call)
    if isinstance(call.func, ast.Attribute) and name in helpers:
        out |= _tokens(helpers[name], names=False)  # gate.wait_entered(2): what the method polls
    return out


def _bodies(function: ast.AST):
    for node in [function, *_own_nodes(function)]:
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                yield body
        for handler in getattr(node, "handlers", []):
            yield handler.body


def _helpers(trees) -> dict[str, ast.AST]:
    """Function (and method) name -> its definition, over these trees."""
    return {name.rsplit(".", 1)[-1]: node for tree in trees for name, node in _functions(tree)}


def scan(
    source: str,
    path: str = "<planted>",
    waiters: frozenset[str] | None = None,
    helpers: dict[str, ast.AST] | None = None,
):
    """Every race pattern in ``source`` (a module's text), as Findings;
    ``waiters`` and ``helpers`` default to this module's own."""
    tree = ast.parse(source, path)
    waiters = pollers([tree]) if waiters is None else waiters
    helpers = {**(helpers or {}), **_helpers([tree])}
    found = []
    for name, function in _functions(tree):
        clock = _clock_names(function)
        for node, in_poll in _walk_polling(function):
            # An assertion in a polling loop is the poll's own deadline.
            if isinstance(node, ast.Assert) and not in_poll and _reads_clock(node.test, clock):
                found.append(Finding(path, node.lineno, name, "clock", ast.unparse(node.test)))
            if _is_sleep(node) and not in_poll:
                found.append(Finding(path, node.lineno, name, "sleep", ast.unparse(node)))
        for call in _process_counts(function):
            found.append(Finding(path, call.lineno, name, "process", ast.unparse(call)))
        for body in _bodies(function):
            for stmt, after in itertools.pairwise(body):
                wait = _wait_call(stmt, waiters)
                if wait is None or not isinstance(after, ast.Assert):
                    continue
                call, results = wait
                asserted = after.test
                reads_result = any(
                    isinstance(n, ast.Name) and n.id in results for n in ast.walk(asserted)
                )
                if not reads_result and not _waited_tokens(call, helpers) & _tokens(asserted):
                    waited, checked = ast.unparse(call)[:80], ast.unparse(asserted)[:80]
                    detail = f"waited on {waited}, asserted {checked}"
                    found.append(Finding(path, after.lineno, name, "wait", detail))
    return sorted(found, key=lambda f: f.line)


def scan_tests() -> list[Finding]:
    paths = sorted(TESTS.rglob("*.py"))
    trees = {p: ast.parse(p.read_text(), str(p)) for p in paths}
    waiters = pollers(list(trees.values()))
    helpers = _helpers(trees.values())
    found = []
    for path in paths:
        found += scan(path.read_text(), str(path.relative_to(REPO)), waiters, helpers)
    return found


def test_no_test_races_the_machine():
    found = scan_tests()
    new = [str(f) for f in found if f.key not in ALLOWED]
    assert not new, "race patterns (docs/testing.md, race rules):\n" + "\n".join(new)
    stale = set(ALLOWED) - {f.key for f in found}
    assert not stale, f"ALLOWED entries that match nothing: {sorted(stale)}"


def test_the_polling_helpers_are_found():
    trees = [ast.parse(p.read_text()) for p in TESTS.rglob("*.py")]
    assert {"wait_until", "wait_jobs", "lookup_until", "settle"} <= pollers(trees)


WAIT_UNTIL = """
import time
def wait_until(predicate, what):
    deadline = time.monotonic() + 20
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.002)
"""

RACY = {
    "elapsed": """
def test_x():
    t0 = time.monotonic()
    run()
    elapsed = time.monotonic() - t0
    assert elapsed < 2
""",
    "clock in assert": """
def test_x():
    deadline = time.time() + 1
    assert time.perf_counter_ns() < 10**9
""",
    "approx": """
def test_x(engine):
    start = time.perf_counter()
    engine.run()
    assert time.perf_counter() - start == pytest.approx(1.0, abs=0.5)
""",
    "wait other value": """
def test_x(engine, caplog):
    wait_until(lambda: engine.metrics.gauge("queued") == 1, "queued")
    assert "store dropped" in caplog.text
""",
    "wait jobs then other": """
def test_x(engine, gauge):
    wait_jobs(engine, [1])
    assert gauge.value == 3
""",
    "sleep": """
def test_x(gate, engine):
    gate.open()
    time.sleep(0.1)
    assert engine.done
""",
    "sleep in a plain loop": """
def test_x(engine):
    for i in range(3):
        engine.submit(i)
        time.sleep(0.01)
""",
    "a count of this process's descriptors": """
def test_x(tmp_path):
    others, dirs = open_fds(os.getpid())
    with open(tmp_path / "f", "w"):
        assert open_fds(os.getpid()) == (others + 1, dirs)
""",
    "a helper that lists every descriptor": """
def _open_fds():
    return set(os.listdir("/proc/self/fd"))

def test_x(below):
    before = _open_fds()
    below.open_dir("a")
    assert _open_fds() == before
""",
    "a count of this process's threads": """
def test_x(engine):
    before = threading.active_count()
    engine.shutdown()
    assert len(threading.enumerate()) == before
""",
}

SAFE = {
    "wait on the asserted value": """
def test_x(engine):
    wait_until(lambda: engine.stats()["hits"] == 2, "two hits")
    assert engine.stats()["hits"] == 2
""",
    "assert on the wait's result": """
def test_x(engine):
    done = wait_jobs(engine, [1])
    assert done[1].success
""",
    "fake clock": """
def test_x(engine_clock, engine):
    t0 = engine_clock()
    engine_clock.advance(5)
    assert engine_clock() - t0 == 5
""",
    "manual clock": """
def test_x():
    clock = ManualClock()
    start = clock()
    clock.advance(1.5)
    assert clock() - start == 1.5
""",
    "sleep in a polling loop": """
def test_x(path):
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            pytest.fail("no file")
        time.sleep(0.01)
""",
    "descriptors filtered to what the test made": """
def test_x(path):
    mine = [fd for fd in os.listdir("/proc/self/fd") if os.readlink(f"/proc/self/fd/{fd}") == path]
    for fd in os.listdir(f"/proc/{os.getpid()}/fd"):
        pass
    assert not mine
""",
    "threads filtered by name": """
def test_x():
    assert not [t for t in threading.enumerate() if t.name.startswith("test_io_")]
""",
    "a held child's descriptors": """
def test_x(child):
    assert open_fds(child.pid) == (3, 0)
""",
    "clock kept out of the assertion": """
def test_x(engine):
    deadline = time.monotonic() + 20
    engine.run(deadline)
    assert engine.done
""",
}


@pytest.mark.parametrize("name", sorted(RACY))
def test_the_scanner_finds_a_planted_race(name):
    waiters = pollers([ast.parse(WAIT_UNTIL)]) | {"wait_jobs"}
    found = scan(WAIT_UNTIL + RACY[name], waiters=waiters)
    assert [f for f in found if f.function != "wait_until"], name


@pytest.mark.parametrize("name", sorted(SAFE))
def test_the_scanner_passes_a_safe_form(name):
    waiters = pollers([ast.parse(WAIT_UNTIL)]) | {"wait_jobs"}
    found = scan(WAIT_UNTIL + SAFE[name], waiters=waiters)
    assert not [str(f) for f in found if f.function != "wait_until"], name
