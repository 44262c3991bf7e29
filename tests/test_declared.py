"""How a setting is declared (``llmkv_fs/declared.py``): ``table_of`` turns a
frozen dataclass of ``declare``d fields into its rows, in field order, with
the check's words for what is valid; an undeclared field fails at once."""

from __future__ import annotations

import dataclasses

import pytest

from llmkv_fs.checks import accepts
from llmkv_fs.declared import Setting, declare, table_of


@accepts("a word")
def _word(key, value):
    return value


@dataclasses.dataclass(frozen=True)
class _Two:
    needed: str = dataclasses.field(metadata=declare("Needed.", _word))
    shared: str = dataclasses.field(
        default="x", metadata=declare("Shared.", _word, vllm_builtin=True)
    )


def test_rows_follow_the_fields_with_defaults_docs_and_valid_words():
    needed, shared = table_of(_Two)
    assert needed == Setting("needed", None, "Needed. Valid: a word.", _word, True, False, "a word")
    assert (shared.key, shared.default, shared.required, shared.vllm_builtin) == (
        "shared",
        "x",
        False,
        True,
    )


def test_a_field_without_a_declaration_is_an_error():
    @dataclasses.dataclass(frozen=True)
    class Bare:
        loose: int = 0

    with pytest.raises(KeyError):
        table_of(Bare)
