"""Test files are named ``tests/<area>/test_<area>_<subject>.py``: the folder is the area whose
behaviour the file claims, whatever package the code under test lives in (docs/DESIGN.md, "Build, package, tests").
So a basename says where the file is, and basenames stay unique under pytest's default import mode.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def misnamed_test_files(root: Path) -> list[str]:
    """Test files under ``root``'s area folders whose name lacks the ``test_<area>_`` prefix."""
    return sorted(str(path.relative_to(root)) for path in root.glob("*/test_*.py")
                  if not path.name.startswith(f"test_{path.parent.name}_"))


def test_every_test_file_carries_its_area_prefix():
    assert len(list(TESTS.glob("*/test_*.py"))) > 50  # the walk found the test tree
    assert misnamed_test_files(TESTS) == []


def test_test_file_basenames_are_unique():
    counts = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, n in counts.items() if n > 1] == []


def test_the_check_sees_a_file_without_its_prefix(tmp_path):
    (tmp_path / "io").mkdir()
    (tmp_path / "io" / "test_io_arena.py").write_text("")
    (tmp_path / "io" / "test_arena.py").write_text("")
    assert misnamed_test_files(tmp_path) == ["io/test_arena.py"]
