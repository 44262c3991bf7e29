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
