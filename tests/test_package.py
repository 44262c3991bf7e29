"""The package itself (``llmkv_fs/__init__.py``): importing it imports no
vLLM, ``FsTier`` is resolved on first access (vLLM loads the tier as
``{"module_path": "llmkv_fs"}``), and any other name is an AttributeError."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.kits import REPO


def test_import_is_cheap_and_fstier_resolves_lazily():
    code = (
        "import sys, llmkv_fs; assert 'vllm' not in sys.modules; "
        "from llmkv_fs.tier.fs_tier import FsTier; assert llmkv_fs.FsTier is FsTier"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=300)


def test_any_other_name_is_an_attribute_error():
    import llmkv_fs

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        llmkv_fs.NoSuchThing  # noqa: B018
