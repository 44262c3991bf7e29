"""The house's own rules, checked against the tree: what docs/architecture.md
and the package docstring say the rooms are, where a module's tests live,
and how long a product function may grow (pyproject.toml's ruff settings
leave branch and statement counts to this rule)."""

import ast
import re

import llmkv_fs
from tests.kits import REPO, TESTS

PACKAGE = REPO / "llmkv_fs"
TOOLS = REPO / "tools"
ARCHITECTURE = REPO / "docs" / "architecture.md"
MAX_FUNCTION_LINES = 60
# Test folders that are not a room: the kits, and tests that cross every
# room at once (the fault matrix, NFS, a real vllm serve, the soak).
NOT_ROOMS = {"kits", "system"}


def _subpackages(folder):
    return {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}


def _folders(folder):
    return {p.name for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"}


def _base_modules():
    return {p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__", "cli")}


def _rooms_block():
    """The code block under "The rooms, one sentence each"."""
    text = ARCHITECTURE.read_text()
    section = text.split("## The rooms, one sentence each", 1)[1]
    return section.split("```", 2)[1]


def _folders_named_under(block, top):
    """Folder names listed (``  name/  sentence``) under the ``top/`` line."""
    names, inside = set(), False
    for line in block.splitlines():
        if re.match(r"^\S", line):
            inside = line.startswith(f"{top}/")
            continue
        m = re.match(r"^  (\w+)/\s", line)
        if inside and m:
            names.add(m.group(1))
    return names


def test_architecture_names_every_room_and_tool_folder_and_no_other():
    block = _rooms_block()
    assert _folders_named_under(block, "llmkv_fs") == _subpackages(PACKAGE)
    assert _folders_named_under(block, "tools") == _folders(TOOLS)
    listed = set(re.findall(r"(\w+)\.py", block.split("tools/", 1)[0]))
    assert listed - {"cli"} == _base_modules()


def test_package_docstring_names_every_room_and_base_module():
    doc = llmkv_fs.__doc__ or ""
    rooms = set(re.findall(r"``llmkv_fs\.(\w+)``", doc))
    assert rooms == _subpackages(PACKAGE) | {"cli"}
    bases = re.search(r"base modules \(([^)]*)\)", doc)
    assert bases is not None
    assert set(re.findall(r"``(\w+)``", bases.group(1))) == _base_modules()


def test_test_folders_mirror_the_rooms():
    """A module's tests are found by its path: tests/engine/block/ for
    llmkv_fs/engine/block/, tests/tools/bench/ for tools/bench/."""
    wrong = []
    for folder in TESTS.rglob("*"):
        if not folder.is_dir() or folder.name == "__pycache__":
            continue
        rel = folder.relative_to(TESTS)
        if rel.parts[0] in NOT_ROOMS:
            continue
        source = REPO / rel if rel.parts[0] == "tools" else PACKAGE / rel
        if not (source / "__init__.py").exists():
            wrong.append(f"tests/{rel} mirrors no package ({source.relative_to(REPO)})")
        if not (folder / "__init__.py").exists():
            wrong.append(f"tests/{rel} is not a package (test module names would collide)")
    assert not wrong, "\n".join(wrong)
    assert not [p.name for p in TESTS.glob("*_kit.py")], "kits live in tests/kits/"


def test_no_product_function_is_longer_than_the_rule():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines}")
    assert not long, "\n".join(long)


# -- every file and symbol the words name exists --------------------------------------------

# A path from the repository's root (not one with a <placeholder> in it), a dotted name
# in the package, and (in a product docstring) a file relative to the package, the
# docstring's folder or one above it.
_REPO_PATH = re.compile(r"(?<![\w./-])((?:llmkv_fs|tools|tests)/[\w./-]*\w)(?![\w/<-])")
_DOTTED = re.compile(r"(?<![\w./])(llmkv_fs(?:\.\w+)+)")
_RELATIVE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|c|md|toml))\b")
# A test named by its file and function (``tests/x/test_y.py::test_z``, and a
# following ``::test_w`` of the same file), and a test file named bare (``test_y.py``).
_TEST_ID = re.compile(r"(tests/[\w/]+\.py)?::(\w+)")
_BARE_TEST_FILE = re.compile(r"(?<![\w./*-])(test_\w+\.py)\b")
# Deliberate exceptions: a file removed from the tree, named in the same paragraph as the
# commit that still holds it (docs/benchmarks.md, "How to run each benchmark", and the
# measurements made with those tools).
_NAMES_ITS_COMMIT = re.compile(r"commit\W[\s\S]{0,120}?\b[0-9a-f]{7,40}\b")


def _docstrings(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc


def _defines(module, name: str) -> bool:
    """``module`` (a .py file) binds ``name`` at its top level (or exports it)."""
    source = module.read_text()
    return bool(
        re.search(rf"(?m)^(?:class|def|async def) {name}\b|^{name}\s*[:=]", source)
        or re.search(rf"(?m)^\s*(?:from \S+ )?import .*\b{name}\b|^\s+{name},$", source)
    )


def _symbol_exists(dotted: str) -> bool:
    """The longest prefix of ``dotted`` that is a module of the package (a compiled
    one by its C source) binds the next part, if there is one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        for module in (base.with_suffix(".py"), base / "__init__.py", base.with_suffix(".c")):
            if module.exists():
                rest = parts[i:]
                return not rest or module.suffix == ".c" or _defines(module, rest[0])
    return False


def _missing_tests(paragraph: str) -> list[str]:
    """Tests named in ``paragraph`` (by file and function, or a file named bare)
    that no file under tests/ holds."""
    missing, last = [], None
    for line in paragraph.splitlines():
        for path, function in _TEST_ID.findall(line):
            last = path or last
            source = REPO / last if last else None
            if source is None or not source.exists():
                continue  # a path that does not exist is reported as a path
            if not re.search(rf"(?m)^\s*(?:async )?(?:def|class) {function}\b", source.read_text()):
                missing.append(f"{last}::{function}")
    names = {p.name for p in TESTS.rglob("test_*.py")}
    missing += [name for name in _BARE_TEST_FILE.findall(paragraph) if name not in names]
    return missing


def stale_references(where: str, text: str, bases=()) -> list[str]:
    """What ``text`` names that is not in the tree: repository paths, dotted symbols of
    the package, and files relative to one of ``bases`` (a product docstring's)."""
    found = []
    for paragraph in text.split("\n\n"):
        excused = _NAMES_ITS_COMMIT.search(paragraph) is not None
        for path in _REPO_PATH.findall(paragraph):
            if not (REPO / path).exists() and not excused:
                found.append(f"{where}: {path}")
        found += [f"{where}: {name}" for name in _missing_tests(paragraph)]
        for dotted in _DOTTED.findall(paragraph):
            if not _symbol_exists(dotted):
                found.append(f"{where}: {dotted}")
        if bases:
            for path in _RELATIVE.findall(paragraph):
                if not any((base / path).exists() for base in bases):
                    found.append(f"{where}: {path}")
    return found


def _packages():
    return [PACKAGE, *(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)]


def room_paths_missing(where: str, text: str) -> list[str]:
    """Files the docs name from a room of the package down
    (``block/contents.py``, ``volume/pinned_root.py``, ``engine/test_engine.py``)
    that neither the package, any of its sub-packages nor tests/ holds."""
    packages = _packages()
    rooms = "|".join(sorted({p.name for p in packages[1:]}))
    pattern = re.compile(rf"(?<![\w./-])((?:{rooms})/(?:[\w-]+/)*[\w-]+\.(?:py|c))\b")
    bases = (*packages, TESTS)
    return [
        f"{where}: {path}"
        for path in pattern.findall(text)
        if not any((base / path).exists() for base in bases)
    ]


def _all_stale_references() -> list[str]:
    found = []
    for doc in sorted((REPO / "docs").glob("*.md")):
        where = str(doc.relative_to(REPO))
        found += stale_references(where, doc.read_text())
        if doc.name != "changelog.md":  # it names what was, on purpose
            found += room_paths_missing(where, doc.read_text())
    for module in sorted(PACKAGE.rglob("*.py")):
        bases = (REPO, PACKAGE, module.parent, *module.parent.parents)
        for doc in _docstrings(module):
            found += stale_references(str(module.relative_to(REPO)), doc, bases)
    return found


def test_every_file_and_symbol_the_docs_and_docstrings_name_exists():
    assert _all_stale_references() == []


def test_a_planted_bad_reference_is_caught():
    bases = (REPO, PACKAGE)
    planted = [
        "See llmkv_fs/engine/no_such_module.py for the rest.",
        "Built by tools/bench/no_such_tool.py.",
        "Tested in tests/engine/test_no_such_thing.py.",
        "Proved by tests/test_house.py::test_no_such_test.",
        "Proved by `tests/test_house.py::test_a_planted_bad_reference_is_caught`, `::test_gone`.",
        "Proved by `test_no_such_file.py`.",
        "Call llmkv_fs.engine.engine.NoSuchEngine first.",
        "The module llmkv_fs.engine.no_such_room says so.",
        "Its twin is engine/block/no_such_step.py.",
    ]
    for text in planted:
        assert stale_references("planted", text, bases), text
    assert room_paths_missing("planted", "the seam, block/bytepath.py, went")
    assert room_paths_missing("good", "block/contents.py, volume/beneath.py") == []
    good = (
        "llmkv_fs/engine/engine.py, tools/bench/engine.py, tests/kits/engine_kit.py, "
        "llmkv_fs.engine.engine.FsEngine, llmkv_fs.engine.block._presence, "
        "engine/block/pause.py, tests/test_house.py::test_a_planted_bad_reference_is_caught, "
        "`::test_every_module_with_logic_has_its_test_file_or_says_why`"
    )
    assert stale_references("good", good, bases) == []
    assert stale_references("good", "as `test_races.py` checks") == []
    # A removed tool named with the commit that holds it is a deliberate exception.
    assert stale_references("old", "`tools/gone.py`, removed after commit ce83199.") == []


# -- every module with logic has its test file where its path says -------------------------

# A product module "with logic" defines a function or a class (constants, a
# re-export or an empty package have nothing of their own to test). Its tests are
# ``tests/<its folder>/test_<module>.py`` (``test_package.py`` for an
# ``__init__.py``), so a newcomer finds them by name. A module tested somewhere
# else is listed here with where and why; an entry that no longer applies fails.
_BENCH_BY_HAND = "untested: llmkv-fs bench is run by hand (docs/benchmarks.md)"
_GC_PASS = "driven through whole gc passes by tests/ops/gc/test_rules.py and test_command.py"
TESTED_ELSEWHERE = {
    "llmkv_fs/cli.py": (
        "each subcommand is tested with its tool (tests/ops/, tests/harness/test_demo.py); "
        "the parser by tests/test_units.py and tests/test_rooms.py (--help without vLLM)"
    ),
    "llmkv_fs/harness/bench_drive.py": _BENCH_BY_HAND,
    "llmkv_fs/harness/bench_fio.py": _BENCH_BY_HAND,
    "llmkv_fs/harness/machine.py": _BENCH_BY_HAND,
    "llmkv_fs/harness/demo_replica.py": "a demo's replica process: tests/harness/test_demo.py",
    "llmkv_fs/harness/demo_report.py": "what the demo prints: tests/harness/test_demo.py",
    "llmkv_fs/harness/driver.py": (
        "the replicas of every tier test (tests/kits/tier_kit.py re-exports it): "
        "tests/tier/test_fs_tier.py and test_plugin.py"
    ),
    "llmkv_fs/layout/run_diff.py": (
        "field by field through llmkv-fs doctor (tests/ops/test_doctor.py) and the "
        "tier's start-up line (tests/tier/test_startup_line.py)"
    ),
    "llmkv_fs/layout/sealed.py": (
        "with the sealed byte path (tests/engine/block/test_sealed.py) and "
        "tests/layout/test_judgement.py, tests/ops/test_sealed_ops.py"
    ),
    "llmkv_fs/ops/blockcheck.py": "verify's per-block check: tests/ops/test_verify.py",
    "llmkv_fs/ops/doctor_against.py": "doctor --against: tests/ops/test_doctor.py",
    "llmkv_fs/ops/events/options.py": (
        "the shared options of announcing tools: tests/ops/events/test_config.py, test_oneshot.py"
    ),
    "llmkv_fs/ops/gc/actions.py": _GC_PASS,
    "llmkv_fs/ops/gc/inventory.py": _GC_PASS,
    "llmkv_fs/ops/gc/lock.py": (
        "across processes and clients: tests/ops/gc/test_command.py, "
        "tests/system/test_untrusted_volume.py"
    ),
    "llmkv_fs/ops/gc/report.py": _GC_PASS,
    "llmkv_fs/ops/gc/sweep.py": _GC_PASS,
    "llmkv_fs/ops/repair.py": "verify --repair: tests/ops/test_verify.py",
    "llmkv_fs/ops/stats_text.py": "what llmkv-fs stats prints: tests/ops/test_stats.py",
    "llmkv_fs/ops/stats_walk.py": "stats' tally per digest: tests/ops/test_stats.py",
    "llmkv_fs/ops/verify_readers.py": "verify's reader threads: tests/ops/test_verify.py",
    "llmkv_fs/ops/verify_text.py": "what llmkv-fs verify prints: tests/ops/test_verify.py",
    "llmkv_fs/tier/hashing.py": (
        "needs vLLM's hash seed: tests/volume/test_leases.py and tests/ops/test_doctor.py"
    ),
    "llmkv_fs/engine/block/contents.py": (
        "the block codec (plain and sealed) through its callers: "
        "tests/engine/block/test_blockio.py, test_checksum_policy.py, test_sealed.py"
    ),
    "llmkv_fs/engine/block/options.py": (
        "the I/O options a place is built with: tests/engine/block/test_piecewise.py, "
        "tests/engine/startup/test_hash_path.py"
    ),
    "llmkv_fs/engine/block/spec.py": (
        "how a step is built in a thread or a worker: tests/engine/test_executor_parity.py"
    ),
    "llmkv_fs/engine/block/stamps.py": (
        "the atime stamps of a load: tests/engine/test_access_and_modes.py"
    ),
    "llmkv_fs/engine/lookup_checks.py": "the lookups' batched checks: tests/engine/test_lookup.py",
    "llmkv_fs/engine/outcomes.py": (
        "every outcome and failure through the engine: tests/engine/test_engine.py, "
        "tests/engine/scheduling/test_scheduler.py"
    ),
    "llmkv_fs/engine/startup/io_setup.py": (
        "which I/O path and options start-up picks: "
        "tests/engine/startup/test_hash_path.py, tests/engine/block/test_piecewise.py"
    ),
    "llmkv_fs/engine/startup/neighbours.py": (
        "the start-up line about other deployments: tests/tier/test_startup_line.py, "
        "tests/system/test_e2e_serve.py"
    ),
    "llmkv_fs/engine/startup/probe.py": "the O_DIRECT probe: tests/engine/test_access_and_modes.py",
    "llmkv_fs/engine/upkeep/prepare.py": (
        "the volume's preparation at start-up: tests/engine/test_roots.py, "
        "tests/volume/test_pinned_root.py"
    ),
    "llmkv_fs/engine/upkeep/signals.py": (
        "the roots' shared signal pages: tests/engine/upkeep/test_housekeeping.py, test_space.py"
    ),
    "llmkv_fs/engine/workers/child.py": (
        "a worker process's loop: tests/engine/workers/test_workers.py"
    ),
    "llmkv_fs/engine/workers/crew.py": (
        "the worker processes' start, death and respawn: tests/engine/workers/test_workers.py"
    ),
    "llmkv_fs/engine/workers/process_executor.py": (
        "the worker-process executor: tests/engine/workers/test_workers.py, "
        "tests/engine/test_executor_parity.py"
    ),
    "llmkv_fs/engine/workers/region.py": (
        "the primary handed to worker processes: tests/engine/workers/test_workers.py, "
        "test_prefault.py"
    ),
}


def has_logic(source: str) -> bool:
    """The module defines a function or a class, at any depth."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return any(isinstance(node, kinds) for node in ast.walk(ast.parse(source)))


def mapped_test_file(module: str) -> str:
    """``llmkv_fs/a/b.py`` -> ``tests/a/test_b.py``; ``llmkv_fs/a/__init__.py`` ->
    ``tests/a/test_package.py``."""
    parts = module.split("/")[1:]
    stem = parts[-1].removesuffix(".py")
    name = "test_package.py" if stem == "__init__" else f"test_{stem}.py"
    return "/".join(["tests", *parts[:-1], name])


def untested_modules(modules: dict[str, str], present: set[str], allowed: dict[str, str]):
    """(modules with logic and neither their test file nor an entry, entries that no
    longer apply: the module is gone, has no logic, or has its test file)."""
    missing, stale = [], []
    for module, source in sorted(modules.items()):
        mapped = mapped_test_file(module) in present
        if has_logic(source) and not mapped and module not in allowed:
            missing.append(f"{module}: no {mapped_test_file(module)} and no entry saying why")
    for module in sorted(allowed):
        source = modules.get(module)
        if source is None or not has_logic(source) or mapped_test_file(module) in present:
            stale.append(f"{module}: stale TESTED_ELSEWHERE entry (tests/test_house.py)")
    return missing, stale


def test_every_module_with_logic_has_its_test_file_or_says_why():
    modules = {str(p.relative_to(REPO)): p.read_text() for p in PACKAGE.rglob("*.py")}
    present = {str(p.relative_to(REPO)) for p in TESTS.rglob("test_*.py")}
    missing, stale = untested_modules(modules, present, TESTED_ELSEWHERE)
    assert not missing + stale, "\n".join(missing + stale)


def test_the_mapping_catches_a_missing_test_and_a_stale_entry():
    modules = {
        "llmkv_fs/room/walk.py": "def walk(): pass",
        "llmkv_fs/room/names.py": "SUFFIX = '.bin'",
        "llmkv_fs/room/__init__.py": "class Room: pass",
        "llmkv_fs/room/told.py": "class Told: pass",
        "llmkv_fs/room/tested.py": "def tested(): pass",
    }
    present = {"tests/room/test_tested.py", "tests/room/test_package.py"}
    allowed = {
        "llmkv_fs/room/told.py": "why",
        "llmkv_fs/room/names.py": "no logic",
        "llmkv_fs/room/tested.py": "has its file",
        "llmkv_fs/room/gone.py": "removed",
    }
    missing, stale = untested_modules(modules, present, allowed)
    assert [m.split(":")[0] for m in missing] == ["llmkv_fs/room/walk.py"]
    assert [s.split(":")[0] for s in stale] == [
        "llmkv_fs/room/gone.py",
        "llmkv_fs/room/names.py",
        "llmkv_fs/room/tested.py",
    ]
