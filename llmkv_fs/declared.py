"""How a setting is declared (config.py holds which settings exist).

A setting is a field of a frozen dataclass whose metadata, made by
``declare``, carries its doc, its check and whether vLLM's built-in fs tier
takes the same key; ``table_of`` turns such a dataclass into the table of
``Setting`` rows that validation, the CLI's ``config-doc`` and the docs
read. Pure data, no I/O: safe from any thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["Setting", "declare", "table_of"]


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    doc: str
    check: Callable[[str, Any], Any]
    required: bool = False
    vllm_builtin: bool = False  # accepted by vLLM's own fs tier with the same meaning
    valid: str = ""  # what the check accepts, in words (shown in the docs)


_DECLARED = "llmkv_fs.setting"  # the metadata key of a declared field


@dataclasses.dataclass(frozen=True)
class _Declared:
    doc: str
    check: Callable[[str, Any], Any]
    vllm_builtin: bool


def declare(
    doc: str, check: Callable[[str, Any], Any], *, vllm_builtin: bool = False
) -> dict[str, _Declared]:
    """A field's metadata: ``check`` must come from ``checks.accepts``."""
    return {_DECLARED: _Declared(doc, check, vllm_builtin)}


def table_of(settings_class: type) -> tuple[Setting, ...]:
    """One Setting per field of ``settings_class``, in field order; a field
    without ``declare`` metadata is a KeyError at import."""
    table = []
    for f in dataclasses.fields(settings_class):
        declared: _Declared = f.metadata[_DECLARED]
        required = f.default is dataclasses.MISSING
        valid = declared.check.valid  # type: ignore[attr-defined]  # see checks.accepts
        table.append(
            Setting(
                f.name,
                None if required else f.default,
                f"{declared.doc} Valid: {valid}.",
                declared.check,
                required=required,
                vllm_builtin=declared.vllm_builtin,
                valid=valid,
            )
        )
    return tuple(table)
