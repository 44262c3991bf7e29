"""The engine package's public names (llmkv_fs/engine/__init__.py): listed
once for the lazy lookup, said again only to type checkers; this holds the
two together and proves each name resolves to where the list says."""

import ast
import importlib

from llmkv_fs import engine
from tests.kits import REPO


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse((REPO / "llmkv_fs" / "engine" / "__init__.py").read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    found = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name}: import it as itself"
            found[alias.name] = node.module
    return found


def test_type_checkers_see_exactly_the_names_the_package_resolves():
    assert _type_checking_imports() == engine._MODULE_OF
    assert sorted(engine.__all__) == sorted(engine._MODULE_OF)


def test_every_public_name_resolves_to_its_module():
    for name, module in engine._MODULE_OF.items():
        assert getattr(engine, name) is getattr(importlib.import_module(module), name)
