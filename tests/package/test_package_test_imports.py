"""No file under tests/ imports a test module (``test_*``): what two test files share lives in a
helper module in tests/ (runtime_models, train_helpers, parallel_training, ...; docs/DESIGN.md,
"Build, package, tests"). A test module reached from another folder works only when pytest happened to put that
folder on the path, so a file run alone could fail; and a test edited for its own sake would change
another. A static check over the source, so a new such import fails here at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def imports_of_test_modules(source: str) -> list[str]:
    """The imports of test modules in ``source``, as ``line: import``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if _is_test_module(module):
                found.append(f"{node.lineno}: from {'.' * node.level}{module} import ...")
            elif not module:  # from . import test_x
                found += [f"{node.lineno}: from {'.' * node.level} import {a.name}" for a in node.names
                          if _is_test_module(a.name)]
    return found


def test_no_file_under_tests_imports_a_test_module():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50  # the walk found the test tree
    offenders = {str(path.relative_to(TESTS)): imports for path in files
                 if (imports := imports_of_test_modules(path.read_text(encoding="utf-8")))}
    assert offenders == {}, "move what these files share into a helper module in tests/"


@pytest.mark.parametrize("source", [
    "from test_train_checkpoint import _run\n",
    "def f():\n    from test_io_file_store import small_tmpfs\n",
    "import test_parallel_runtime as t\n",
    "from tests.runtime.test_runtime_precision import train_mixed_reference\n",
    "from . import test_runtime_state_dict\n",
])
def test_the_check_sees_an_import_of_a_test_module(source):
    assert imports_of_test_modules(source)


@pytest.mark.parametrize("source", [
    "from runtime_models import tiny_gpt, train_engine\n",
    "import train_helpers\nfrom _dist import run_ranks\n",
    "from pystronghold.runtime import testing_utils\n",
    "code = 'import test_io_file_store'\n",  # a subprocess's own code, not an import of this module
])
def test_the_check_allows_helper_and_package_imports(source):
    assert imports_of_test_modules(source) == []
