"""The package is built in floors: a module imports only from its own floor and the floors below
(STYLE: "a floor importing from above, through a function-level import" is what we avoid). A static
check over the source, in the style of the private-names check, so a new upward import fails here.

What is read, from the syntax alone: every ``import`` / ``from ... import`` of a ``pystronghold``
module, at module level and inside functions alike (a function-level import that reaches up is
still a dependency upward, only hidden). A unit is a subpackage (``runtime``, ``parallel``, ...) or
a top-level module (``options``, ``cli``, ...); ``__init__`` is the package face
(``pystronghold/__init__.py``), ``kernels`` the Triton kernels (``kernels/``, installed as
``pystronghold.kernels``), ``_C`` the compiled extension.

Inside ``runtime`` the rooms (its subpackages) have floors of their own, the same way
(``RUNTIME_FLOORS``): ``runtime.memory`` never imports ``runtime.streaming``; the modules at the top
of ``runtime/`` (the engine, its build, ``wrap``) may import every room.

Circles are checked on the module graph (one node per ``.py`` file, function-level imports
counted): no module reaches itself through imports, so no import is ever deferred into a function
just to break a cycle. Imports under ``if TYPE_CHECKING:`` never run, so they close no circle; they
still count for the floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pystronghold"

FLOORS: tuple[tuple[str, ...], ...] = (
    ("_C", "_ext", "extras", "options", "interrupts", "kernels"),  # leaves: extension, optional deps, options, signals, Triton
    ("settings",),  # the option components shared by the commands and the layers under them
    ("ops", "io", "data", "token_files", "records", "tokenized", "lr_schedule"),  # native ops, file I/O, data
    ("optim", "nn", "parallel"),  # optimizers, fused ops, TP/DP primitives
    ("models", "strategy"),  # GPT and Hugging Face models; Whale's scopes and their layout
    ("runtime",),  # the window runtime: wrap, Engine, store, trace
    ("planner",),  # costs, plans, the pipeline's arithmetic
    ("pipelining",),  # pipeline stages on the runtime
    ("train",),  # pystronghold train: loop, options, checkpoints, metrics
    ("__init__",),  # the package face (pystronghold.wrap, ...)
    ("info", "bench_suite", "cli", "__main__"),  # the command line
)
"""The floors, lowest first: a unit imports only from its own floor and those below."""

FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}

RUNTIME_FLOORS: tuple[tuple[str, ...], ...] = (
    ("memory", "tracing", "settings", "blocks", "states"),  # store and layout, trace, options, into the model, state dicts
    ("backends", "optimizer", "streaming"),  # CPU/CUDA window, the step and its updates, the window and its schedule
    ("",),  # runtime/ itself: the Engine, its build and wrap-time checks, the memory report, wrap
)
"""The rooms of ``pystronghold.runtime`` (its subpackages), lowest first; ``""`` is the modules
directly in ``runtime/``."""

RUNTIME_FLOOR = {room: level for level, rooms in enumerate(RUNTIME_FLOORS) for room in rooms}


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for the package and its kernels."""
    files = {}
    for base, prefix in ((PACKAGE, "pystronghold"), (ROOT / "kernels", "pystronghold.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([prefix, *parts])] = path
    return files


def imports_of(name: str, source: str, modules: set[str], is_package: bool = False) -> list[tuple[str, int, str]]:
    """The package modules module ``name`` imports: (module, line, where: "module", "function" or
    "typing" for ``if TYPE_CHECKING:``). ``from
    pystronghold.x import y`` counts as ``pystronghold.x.y`` when that is a module, else as
    ``pystronghold.x``; ``pystronghold._C`` (the extension) is a module of its own."""
    known = modules | {"pystronghold._C"}

    def resolve(dotted: str) -> str:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted

    tree = ast.parse(source)
    def imports_under(kinds) -> set[int]:
        return {id(sub) for node in ast.walk(tree) if kinds(node)
                for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))}

    in_function = imports_under(lambda node: isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
    typing_only = imports_under(lambda node: isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "pystronghold" and (module := resolve(target)) and module != name:
                where = "typing" if id(node) in typing_only else "function" if id(node) in in_function else "module"
                if (module, node.lineno, where) not in found:
                    found.append((module, node.lineno, where))
    return found


def unit_of(module: str) -> str:
    """The floor unit of a dotted module name (``pystronghold.runtime.api`` -> ``runtime``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_of(module: str) -> str | None:
    """The runtime room of a dotted module name (``pystronghold.runtime.memory.store`` -> ``memory``,
    ``pystronghold.runtime.engine`` -> ``""``), None outside ``runtime``."""
    parts = module.split(".")
    if parts[:2] != ["pystronghold", "runtime"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in RUNTIME_FLOOR else ""


def import_graph() -> dict[str, list[tuple[str, int, str]]]:
    files = _module_files()
    names = set(files)
    return {name: imports_of(name, path.read_text(encoding="utf-8"), names, path.name == "__init__.py")
            for name, path in files.items()}


def upward_imports(graph) -> list[str]:
    """Every import that reaches a higher floor, as ``module:line -> module``."""
    return [f"{name}:{line} -> {target}{'' if where == 'module' else f' ({where})'}"
            for name, targets in graph.items() for target, line, where in targets
            if FLOOR[unit_of(target)] > FLOOR[unit_of(name)]]


def upward_room_imports(graph) -> list[str]:
    """Every import inside ``runtime`` that reaches a higher room, as ``module:line -> module``."""
    return [f"{name}:{line} -> {target}{'' if where == 'module' else f' ({where})'}"
            for name, targets in graph.items() if room_of(name) is not None
            for target, line, where in targets
            if room_of(target) is not None and RUNTIME_FLOOR[room_of(target)] > RUNTIME_FLOOR[room_of(name)]]


def circles(graph, *, typing: bool = False) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted; imports that
    run (not ``TYPE_CHECKING`` ones), or with ``typing`` those too."""
    edges = {name: sorted({t for t, _, where in targets if t in graph and (typing or where != "typing")})
             for name, targets in graph.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_unit_has_a_floor():
    assert sorted({unit_of(name) for name in _module_files()} - set(FLOOR)) == []


def test_the_table_keeps_the_layers_in_order():
    """parallel/ below models/ below runtime/ below planner/ below the pipeline; models/ below the
    package face."""
    assert FLOOR["parallel"] < FLOOR["models"] < FLOOR["runtime"] < FLOOR["planner"] < FLOOR["pipelining"]
    assert FLOOR["runtime"] < FLOOR["train"] < FLOOR["__init__"]


def test_no_import_reaches_up_a_floor():
    assert upward_imports(import_graph()) == [], "move the code to its floor, or the import's target down"


def test_every_runtime_room_has_a_floor():
    rooms = {path.parent.name for path in (PACKAGE / "runtime").glob("*/__init__.py")}
    assert sorted(rooms ^ (set(RUNTIME_FLOOR) - {""})) == []


def test_no_runtime_room_imports_one_above_it():
    assert upward_room_imports(import_graph()) == [], "move the code to its room, or the import's target down"


@pytest.mark.parametrize("name, source, upward", [
    ("pystronghold.runtime.memory.store", "from pystronghold.runtime.streaming.window import Window\n",
     ["pystronghold.runtime.memory.store:1 -> pystronghold.runtime.streaming.window"]),
    ("pystronghold.runtime.optimizer.step", "def f():\n    from pystronghold.runtime import engine\n",
     ["pystronghold.runtime.optimizer.step:2 -> pystronghold.runtime.engine (function)"]),
    ("pystronghold.runtime.streaming.executor", "from ..memory import layout\nfrom pystronghold.optim import hyper\n",
     []),
    ("pystronghold.runtime.engine", "from pystronghold.runtime.streaming import relay\n", []),
])
def test_the_check_sees_an_import_up_a_runtime_room(name, source, upward):
    modules = set(_module_files())
    assert upward_room_imports({name: imports_of(name, source, modules)}) == upward


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []


TYPE_CIRCLES_TO_GO = [["pystronghold.planner.plan", "pystronghold.planner.sequence"]]
"""Circles closed only by ``TYPE_CHECKING`` imports, still to be untied (none may be added)."""


def test_no_circle_even_of_type_only_imports():
    """A type-only import back still ties two modules into one idea: name what is needed (a
    ``Protocol``) on the lower side instead."""
    assert circles(import_graph(), typing=True) == TYPE_CIRCLES_TO_GO


@pytest.mark.parametrize("name, source, upward", [
    ("pystronghold.runtime.engine", "def f():\n    from pystronghold.planner.plan import make_plan\n",
     ["pystronghold.runtime.engine:2 -> pystronghold.planner.plan (function)"]),
    ("pystronghold.models.hf", "import pystronghold\n", ["pystronghold.models.hf:1 -> pystronghold"]),
    ("pystronghold.parallel.groups", "from ..runtime.settings import config\n",
     ["pystronghold.parallel.groups:1 -> pystronghold.runtime.config"]),
    ("pystronghold.runtime.api", "from pystronghold.models.hf import load_lazy\n", []),
])
def test_the_check_sees_an_upward_import(name, source, upward):
    modules = set(_module_files())
    assert upward_imports({name: imports_of(name, source, modules)}) == upward


def test_the_check_sees_a_circle():
    graph = {"pystronghold.a": [("pystronghold.b", 1, "module")], "pystronghold.b": [("pystronghold.c", 1, "function")],
             "pystronghold.c": [("pystronghold.a", 1, "module")], "pystronghold.d": [("pystronghold.a", 1, "module")]}
    assert circles(graph) == [["pystronghold.a", "pystronghold.b", "pystronghold.c"]]
    graph["pystronghold.c"] = [("pystronghold.a", 1, "typing")]
    assert circles(graph) == []
