"""The import rule of docs/architecture.md, enforced.

Each room is imported, module by module, in a fresh process whose import
system refuses the rooms it must not use -- and vLLM and torch, where those
are forbidden -- so a wrong arrow fails here, naming the module that drew it.
A second check reads every import statement, including the lazy ones inside
functions, for arrows between rooms.
"""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
PACKAGE = REPO / "llmkv_fs"

# room -> the rooms it may import. Any room may import the base modules (the
# top-level modules other than the command line: config.py, units.py, ...).
MAY_IMPORT = {
    "layout": set(),
    "volume": {"layout"},
    "engine": {"layout", "volume"},
    "tier": {"engine", "layout", "volume"},
    "ops": {"layout", "volume"},
    "harness": {"tier", "engine", "layout", "volume", "ops"},
}
ROOMS = set(MAY_IMPORT)
HEAVY = ("vllm", "torch")
MAY_IMPORT_HEAVY = {"tier", "harness"}  # the harness lazily: see the command line test
COMMAND_LINE = ("cli", "__main__")  # on top of every room

# Runs first in each process: sys.argv[1] lists what must not be imported,
# top-level names (vllm, torch) and rooms of llmkv_fs alike.
BLOCKER = r"""
import importlib, sys
blocked = set(sys.argv[1].split(",")) - {""}

class Forbidden:
    def find_spec(self, name, path=None, target=None):
        parts = name.split(".")
        room = parts[1] if parts[0] == "llmkv_fs" and len(parts) > 1 else None
        if parts[0] in blocked or room in blocked:
            raise ImportError(f"{name} must not be imported here (tests/test_rooms.py)")
        return None

sys.meta_path.insert(0, Forbidden())
"""
IMPORT_ALL = (
    BLOCKER
    + """
for module in sys.argv[2:]:
    importlib.import_module(module)
print("imported", len(sys.argv) - 2)
"""
)
RUN_COMMAND_LINE = (
    BLOCKER
    + """
import runpy
sys.argv = ["python -m llmkv_fs", *sys.argv[2:]]
runpy.run_module("llmkv_fs", run_name="__main__")
"""
)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_modules(room: str) -> list[str]:
    return sorted(module_name(p) for p in (PACKAGE / room).rglob("*.py"))


def base_modules() -> list[str]:
    return sorted(module_name(p) for p in PACKAGE.glob("*.py") if p.stem not in COMMAND_LINE)


def run_blocked(script: str, blocked: set[str], *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", script, ",".join(sorted(blocked)), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def import_blocked(modules: list[str], blocked: set[str]) -> None:
    done = run_blocked(IMPORT_ALL, blocked, *modules)
    assert done.stdout.strip() == f"imported {len(modules)}"


def test_every_package_is_a_room_and_every_top_module_is_base_or_the_command_line():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == ROOMS
    assert {p.stem for p in PACKAGE.glob("*.py")} >= {"__init__", "config", *COMMAND_LINE}


# The rooms that may import vLLM load it in their fresh process (~20 s each):
# the integration lane; every room's import statements are read in the fast
# lane anyway (test_no_lazy_import_crosses_the_rule_either).
@pytest.mark.parametrize(
    "room",
    [
        pytest.param(room, marks=pytest.mark.integration) if room in MAY_IMPORT_HEAVY else room
        for room in sorted(ROOMS)
    ],
)
def test_room_imports_only_what_the_rule_allows(room):
    blocked = ROOMS - MAY_IMPORT[room] - {room}
    if room not in MAY_IMPORT_HEAVY:
        blocked |= set(HEAVY)
    elif importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    import_blocked(room_modules(room), blocked)


def test_base_modules_import_no_room_and_no_vllm():
    import_blocked(base_modules(), ROOMS | set(HEAVY))


def test_command_line_starts_without_vllm_or_torch():
    """``llmkv-fs --help`` and the volume tools start without vLLM or torch:
    the harness imports them only when a demo or bench runs."""
    import_blocked(["llmkv_fs.cli", "llmkv_fs.__main__"], set(HEAVY))
    for command in ("", "gc", "stats", "verify", "bench", "demo", "config-doc"):
        done = run_blocked(RUN_COMMAND_LINE, set(HEAVY), *command.split(), "--help")
        assert done.stdout.startswith(f"usage: python -m llmkv_fs {command}".strip())


def arrows(path: Path) -> set[tuple[str, int]]:
    """(room, line) for every ``llmkv_fs.<room>`` an import statement in
    ``path`` names, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "llmkv_fs" and len(parts) > 1 and parts[1] in ROOMS:
                found.add((parts[1], node.lineno))
    return found


def test_the_product_never_imports_what_tests_or_measures_it():
    """tools/ (and tests/) are outside the wheel: no module of llmkv_fs may
    name them in an import statement, lazy ones included."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            wrong += [
                f"{path.relative_to(REPO)}:{node.lineno} imports {name}"
                for name in names
                if name.split(".")[0] in ("tools", "tests", "conftest")
                or name.split(".")[0].endswith("_kit")
            ]
    assert not wrong, "\n".join(wrong)


def test_no_lazy_import_crosses_the_rule_either():
    wrong = []
    for room in ROOMS:
        for path in (PACKAGE / room).rglob("*.py"):
            wrong += [
                f"{path.relative_to(REPO)}:{line} imports {target}"
                for target, line in arrows(path)
                if target != room and target not in MAY_IMPORT[room]
            ]
    for path in PACKAGE.glob("*.py"):
        if path.stem in COMMAND_LINE:
            continue
        # The package's lazy ``llmkv_fs.FsTier`` (vLLM's module_path) is the one exception.
        allowed = {"tier"} if path.name == "__init__.py" else set()
        wrong += [
            f"{path.relative_to(REPO)}:{line} imports {target}"
            for target, line in arrows(path)
            if target not in allowed
        ]
    assert not wrong, "\n".join(sorted(wrong))


# -- inside the engine room ------------------------------------------------------------
# Its sub-rooms (docs/architecture.md, "The engine"): what each may import
# of the others. ``outcomes`` is the engine's vocabulary (a top-level module of
# the room, like engine.py, lookup.py and __init__.py, which may import every
# sub-room). Scheduling knows nothing of how a block moves; moving one block
# knows nothing of who runs it; the executors sit on top of both.
ENGINE = PACKAGE / "engine"
ENGINE_MAY_IMPORT = {
    "scheduling": {"outcomes"},
    "upkeep": {"outcomes"},
    "block": {"outcomes", "upkeep"},
    "startup": {"outcomes", "block", "upkeep"},
    "threads": {"outcomes", "scheduling", "block", "startup"},
    "workers": {"outcomes", "scheduling", "block", "startup", "upkeep"},
}
ENGINE_PARTS = {*ENGINE_MAY_IMPORT, *(p.stem for p in ENGINE.glob("*.py") if p.stem != "__init__")}


def engine_arrows(path: Path) -> set[tuple[str, int]]:
    """(engine part, line) for every ``llmkv_fs.engine.<part>`` an import
    statement in ``path`` names (a bare ``from llmkv_fs.engine import X``
    is the room's public face: __init__, hence every part)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] != ["llmkv_fs", "engine"]:
                continue
            if len(parts) == 2 or (len(parts) == 3 and parts[2] not in ENGINE_PARTS):
                found.add(("__init__", node.lineno))
            elif parts[2] in ENGINE_PARTS:
                found.add((parts[2], node.lineno))
    return found


def test_every_engine_package_is_a_sub_room():
    packages = {p.parent.name for p in ENGINE.glob("*/__init__.py")}
    assert packages == set(ENGINE_MAY_IMPORT)


@pytest.mark.parametrize("sub_room", sorted(ENGINE_MAY_IMPORT))
def test_engine_sub_room_imports_only_what_the_rule_allows(sub_room):
    """Read from the import statements (lazy ones too) only: importing any
    sub-room runs the room's __init__, which imports them all."""
    wrong = []
    for path in (ENGINE / sub_room).rglob("*.py"):
        wrong += [
            f"{path.relative_to(REPO)}:{line} imports engine.{target}"
            for target, line in engine_arrows(path)
            if target != sub_room and target not in ENGINE_MAY_IMPORT[sub_room]
        ]
    assert not wrong, "\n".join(sorted(wrong))
