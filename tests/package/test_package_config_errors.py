"""A bad option is a ``ConfigError`` (``pystronghold.options``), wherever it is found: a static check
over the source that no ``raise ValueError(...)`` names a flag first (its message, a string or an
f-string, starting with "--"). The CLI reports a ValueError as bad input too, so a plain one works
there; this keeps the one error type of bad options one type, for callers of the Python API that
catch it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pystronghold"


def _leading_text(node: ast.expr) -> str | None:
    """The literal text a message expression starts with: a string, an f-string's first part, the
    left end of a concatenation; None when it starts with a value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return _leading_text(node.values[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _leading_text(node.left)
    return None


def flag_value_errors(source: str) -> list[int]:
    """Lines of ``source`` raising a ValueError whose message starts with a flag ("--...")."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args \
                and isinstance(node.exc.func, ast.Name) and node.exc.func.id == "ValueError":
            text = _leading_text(node.exc.args[0])
            if text is not None and text.startswith("--"):
                lines.append(node.lineno)
    return lines


def test_the_check_sees_every_form_of_a_message_naming_a_flag():
    source = '''
def f(x, flag):
    raise ValueError("--a must be positive")
    raise ValueError(f"--b {x}: bad")
    raise ValueError(
        f"--c {x} "
        "is bad")
    raise ValueError("--d " + str(x))
    raise ValueError(f"{flag} is a value, not a literal flag")
    raise ValueError("a message naming --e later")
    raise ConfigError("--f is the right type")
    raise RuntimeError("--g is not about a value")
'''
    assert flag_value_errors(source) == [3, 4, 5, 8]


def test_no_value_error_names_a_flag_first():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line in flag_value_errors(path.read_text())]
    assert not found, f"raise ConfigError, not ValueError, for a bad option: {found}"
