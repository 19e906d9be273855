"""The docstring under each field of a config dataclass: the help text of the options generated
from it (``pystronghold train``'s in ``train/command.py``, ``pystronghold plan``'s in
``planner/command.py``). Torch-free, so the CLI's ``--help`` stays fast."""

from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["field_docs"]


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (attribute docstrings, read from source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
