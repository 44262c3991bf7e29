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


def stale_references(where: str, text: str, bases=()) -> list[str]:
    """What ``text`` names that is not in the tree: repository paths, dotted symbols of
    the package, and files relative to one of ``bases`` (a product docstring's)."""
    found = []
    for paragraph in text.split("\n\n"):
        excused = _NAMES_ITS_COMMIT.search(paragraph) is not None
        for path in _REPO_PATH.findall(paragraph):
            if not (REPO / path).exists() and not excused:
                found.append(f"{where}: {path}")
        for dotted in _DOTTED.findall(paragraph):
            if not _symbol_exists(dotted):
                found.append(f"{where}: {dotted}")
        if bases:
            for path in _RELATIVE.findall(paragraph):
                if not any((base / path).exists() for base in bases):
                    found.append(f"{where}: {path}")
    return found


def _all_stale_references() -> list[str]:
    found = []
    for doc in sorted((REPO / "docs").glob("*.md")):
        found += stale_references(str(doc.relative_to(REPO)), doc.read_text())
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
        "Call llmkv_fs.engine.engine.NoSuchEngine first.",
        "The module llmkv_fs.engine.no_such_room says so.",
        "Its twin is engine/block/no_such_step.py.",
    ]
    for text in planted:
        assert stale_references("planted", text, bases), text
    good = (
        "llmkv_fs/engine/engine.py, tools/bench/engine.py, tests/kits/engine_kit.py, "
        "llmkv_fs.engine.engine.FsEngine, llmkv_fs.engine.block._presence, "
        "engine/block/pause.py"
    )
    assert stale_references("good", good, bases) == []
    # A removed tool named with the commit that holds it is a deliberate exception.
    assert stale_references("old", "`tools/gone.py`, removed after commit ce83199.") == []
