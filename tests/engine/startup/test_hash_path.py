"""Which xxh3 code the checksum runs (engine/startup/hash_path.py), as the
start-up line and the ``llmkv_fs_checksum_xxh3`` config-info label say it:
from the architecture, the CPU flags and the xxhash version. The line itself
is checked in tests/engine/scheduling/test_io_priority.py, in both io modes."""

import pytest

from llmkv_fs.engine.startup.hash_path import xxh3_path_for

X86_AVX512 = frozenset({"sse2", "avx2", "avx512f"})


@pytest.mark.parametrize(
    "machine,flags,version,path",
    [
        ("x86_64", X86_AVX512, "4.1.0", "avx512"),
        ("x86_64", frozenset({"sse2", "avx2"}), "4.1.0", "avx2"),
        ("x86_64", frozenset({"sse2"}), "4.2", "sse2"),
        ("x86_64", X86_AVX512, "4.0.1", "sse2-only"),
        ("x86_64", X86_AVX512, "3.6.0", "sse2-only"),
        ("x86_64", X86_AVX512, "dev", "sse2-only"),
        ("aarch64", frozenset({"asimd"}), "4.1.0", "aarch64-build"),
    ],
)
def test_xxh3_path_follows_architecture_cpu_flags_and_xxhash_version(machine, flags, version, path):
    assert xxh3_path_for(machine, flags, version) == path
