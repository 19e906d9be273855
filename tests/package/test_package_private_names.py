"""No module of the package reads another module's private names (docs/DESIGN.md, STYLE: "add a
public accessor instead"). A static check over the source, so a new reach-in fails here at once.

What counts as a reach-in, from the syntax alone (no types):
- ``from pystronghold.x import _name``;
- ``obj._name`` where ``obj`` is not ``self``/``cls`` and ``_name`` is defined nowhere in the
  reading module; when ``obj`` is itself an attribute (``self._engine._engine``), ``_name`` must be
  a function or class of the reading module (a private helper of a class in that module).
Allowed by name: torch's ``Module._buffers``/``_parameters`` and ``Tensor._version`` (no public
way to assign a buffer in place or see in-place writes), ``Tensor._base`` (the tensor a view was
made from: none either), ``torch._foreach_norm`` (torch's documented foreach API; the per-tensor
norms ``clip_grad_norm_`` takes on CUDA, which the device norm path must reproduce bit for bit),
peft's ``LoraConfig._register_custom_module`` (its documented, experimental dispatch of LoRA layers
for layer classes it does not know: the GPT's linear layers), and the native classes behind
``native()`` (``_C._CopyEngine``...), which their Python wrappers own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pystronghold"
ALLOWED_PRIVATE = {"_buffers", "_parameters", "_version", "_base", "_foreach_norm", "_register_custom_module",
                   "_exit"}  # os._exit: public, documented stdlib


def _defined(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(functions and classes, every other name bound) of a module: defs, assignments, slots."""
    defs, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            bound.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            bound |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return defs, bound | defs


def private_reads(source: str) -> list[str]:
    """The reach-ins of one module's ``source`` (see the module doc), as ``line: code``."""
    tree = ast.parse(source)
    defs, bound = _defined(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pystronghold"):
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls") or node.attr in ALLOWED_PRIVATE:
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "native":
            continue
        if node.attr in (bound if isinstance(base, ast.Name) else defs):
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_names():
    offenders = {str(path.relative_to(PACKAGE)): reads for path in sorted(PACKAGE.rglob("*.py"))
                 if (reads := private_reads(path.read_text(encoding="utf-8")))}
    assert offenders == {}, "add a public accessor instead of reading these private names"


@pytest.mark.parametrize("source", [
    "from pystronghold.runtime.tracing.trace import Tracer, _lanes\n",
    "def f(engine):\n    engine._step()\n",
    "class Store:\n    def __init__(self, engine):\n        self._engine = engine\n"
    "    def write(self):\n        return self._engine._engine\n",
])
def test_the_check_sees_a_reach_in(source):
    assert private_reads(source)


@pytest.mark.parametrize("source", [
    "class Lease:\n    def wait(self):\n        self._tier._wait()\nclass Tier:\n    def _wait(self):\n        pass\n",
    "class Handle:\n    __slots__ = ('_req',)\ndef requests(handles):\n    return [h._req for h in handles]\n",
    "def move(module):\n    return module._buffers\n",
])
def test_the_check_allows_a_modules_own_private_names(source):
    assert private_reads(source) == []
