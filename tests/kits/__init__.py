"""What the tests share: fixtures' machinery, fake volumes, services on
loopback. Imported as ``tests.kits.<name>``; the repository root is on
``sys.path`` (pytest's rootdir: every test folder is a package)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
KITS = TESTS / "kits"
