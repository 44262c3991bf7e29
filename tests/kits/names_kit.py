"""Whole paths of the volume's names that only tests build (the product
builds the last component, llmkv_fs/layout/names.py ``temp_name`` and
``probe_name``, relative to a directory descriptor)."""

from __future__ import annotations

import os

from llmkv_fs.layout.names import probe_name, temp_name


def temp_path(final_path: str, host: str, pid: int, nonce: str) -> str:
    """The temp file a writer of ``final_path`` creates next to it."""
    directory, name = os.path.split(final_path)
    return f"{directory}/{temp_name(name, host, pid, nonce)}"


def probe_path(directory: str, host: str, pid: int) -> str:
    """The O_DIRECT probe file a starting engine writes in ``directory``."""
    return f"{directory}/{probe_name(host, pid)}"
