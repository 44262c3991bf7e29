"""What a test sees of a cache volume: the files under a root (or a rank
directory), sorted, by kind; and one way to damage a block in place.

No vLLM, no engine: plain directory walks, usable from every test.
"""

from __future__ import annotations

import os


def files_under(root: str) -> list[str]:
    """Every regular name below ``root`` (symlinks included, directories not), sorted."""
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names)


def temp_files(root: str) -> list[str]:
    return [p for p in files_under(root) if p.endswith(".tmp")]


def block_files(root: str) -> list[str]:
    """Published block files: ``.bin`` names outside the quarantine."""
    return [p for p in files_under(root) if p.endswith(".bin") and "/.quarantine/" not in p]


def quarantined(root: str) -> list[str]:
    """What was moved aside into any ``.quarantine`` directory below ``root``
    (links to directories included), sorted."""
    return sorted(
        os.path.join(d, n)
        for d, _, _ in os.walk(root)
        if os.path.basename(d) == ".quarantine"
        for n in os.listdir(d)
    )


def flip_a_bit(path: str, offset: int = 12345) -> None:
    """Damage a block in place: same size, one payload bit flipped."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
