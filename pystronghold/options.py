"""Settings as dataclass fields, and the command-line options generated from them.

Each setting is declared once, as a field (with its docstring) of the dataclass of the component
that owns it, validated in ``__post_init__``. ``add_options`` generates argparse options from a
job config (``TrainConfig``, ``PlanRequest``) and ``from_args`` builds it back from the parsed
arguments. ``option(...)`` sets a field's command-line metadata: ``flag``, ``help`` (default: the
docstring), ``choices``, ``metavar``, ``parse(text, flag)``, ``none_text``, ``negated``,
``cli=False``. Validation raises ``ConfigError``, a ValueError naming the field as the caller
wrote it (``RuntimeConfig.window`` in Python, ``--window`` on the command line).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import textwrap

__all__ = ["option", "component", "ConfigError", "field_docs", "flag_of", "add_options", "from_args", "given_options",
           "parse_bytes", "one_line_error", "first_line", "Parser"]

_TYPES = {"str": str, "int": int, "float": float}
_METAVARS = {"int": "N", "float": "X", "str": "TEXT"}


def option(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, flag: str | None = None,
           help: str | None = None, choices=None, metavar: str | None = None, parse=None,
           none_text: str | None = None, negated: bool = False, cli: bool = True):
    """A dataclass field with command-line metadata (see the module docstring for each key)."""
    metadata = {key: value for key, value in dict(flag=flag, help=help, choices=choices, metavar=metavar,
                                                  parse=parse, none_text=none_text).items() if value is not None}
    if negated:
        metadata["negated"] = True
    if not cli:
        metadata["cli"] = False
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def component(default_factory, *, only: tuple[str, ...] | None = None, hide: tuple[str, ...] = ()):
    """A job config's field holding one component's config, made by ``default_factory`` (whose
    values are the command's defaults). Its fields are options of the command, except those with
    ``cli=False`` and those in ``hide``; ``only`` names the fields to expose instead (a command that
    models a few settings of a large component, as the planner does)."""
    return dataclasses.field(default_factory=default_factory,
                             metadata={"component": True, "only": only, "hide": tuple(hide)})


def flag_of(f: dataclasses.Field) -> str:
    """The command-line name of field ``f``."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


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


# ---- errors naming the field as the caller wrote it

_REF = re.compile(r"`([A-Za-z_]\w*)(=[^`]*)?`")


class ConfigError(ValueError):
    """A bad value of field ``subject`` of ``config`` (raised in its ``__post_init__``).

    ``subject`` and the fields that ``problem`` names in backquotes are written ``name`` (the field),
    ``name=`` (the field and its value) or ``name=LITERAL`` (the field set to a Python literal).
    ``str()`` is the Python form, ``RuntimeConfig.nvme_states='all' needs nvme_dir``;
    ``on_command_line()`` the form of the generated CLI, ``--nvme-states all needs --nvme``.

    ``ConfigError(message)``: a check made where no option object is at hand (a layer that the
    Python API reaches too, as ``models.hf`` or ``wrap``), its one-line message naming the flag
    itself; both forms are ``message``.
    """

    def __init__(self, config, subject: str | None = None, problem: str | None = None) -> None:
        if subject is None:  # ConfigError(message)
            config, problem = None, str(config)
        self.config, self.subject, self.problem = config, subject, problem
        super().__init__(self._message(cli=False))

    def on_command_line(self) -> str:
        """The message with flags and command-line values instead of Python names."""
        return self._message(cli=True)

    def _message(self, *, cli: bool) -> str:
        if self.config is None:
            return self.problem
        subject = self._name(self.subject, cli)
        if not cli:
            subject = f"{type(self.config).__name__}.{subject}"
        problem = _REF.sub(lambda m: self._name(m.group(0)[1:-1], cli), self.problem)
        return subject + ("" if problem.startswith((":", ",", ";")) else " ") + problem

    def _name(self, ref: str, cli: bool) -> str:
        name, eq, literal = ref.partition("=")
        f = next((f for f in dataclasses.fields(self.config) if f.name == name), None)
        if f is None:
            raise TypeError(f"ConfigError: {type(self.config).__name__} has no field {name!r}")
        value = getattr(self.config, name) if not literal else ast.literal_eval(literal)
        if not cli or not f.metadata.get("cli", True):
            return name + (f"={literal or repr(value)}" if eq else "")
        if not eq:
            return flag_of(f)
        text = f.metadata.get("none_text", "none") if value is None else str(value)
        return f"{flag_of(f)} {text}"


# ---- argparse from a job config

def _options(job_field: dataclasses.Field, cls) -> list[dataclasses.Field]:
    """The fields of component ``cls`` that are options of the job (see ``component``)."""
    only, hide = job_field.metadata.get("only"), job_field.metadata.get("hide", ())
    out = [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and f.name not in hide
           and (only is None or f.name in only)]
    missing = (set(only or ()) - {f.name for f in out}) | (set(hide) - {f.name for f in dataclasses.fields(cls)})
    if missing:  # a renamed field must not silently appear on (or vanish from) the command line
        raise TypeError(f"component {job_field.name}: {cls.__name__} has no option field {sorted(missing)}")
    return out


def _add_option(container, f: dataclasses.Field, default, dest: str, doc: str) -> None:
    flag = flag_of(f)
    help_text = (f.metadata.get("help") or doc).replace("%", "%%")  # argparse formats help with %
    kind = str(f.type).replace("| None", "").strip()
    if kind == "bool":
        if f.metadata.get("negated"):
            if default is not True:
                raise TypeError(f"option {flag}: a negated switch needs a field that is on by default")
            action = "store_false"
        else:
            action = argparse.BooleanOptionalAction if default else "store_true"
        container.add_argument(flag, dest=dest, action=action, default=argparse.SUPPRESS, help=help_text)
        return
    if kind == "list[str]":
        container.add_argument(flag, dest=dest, nargs="+", default=argparse.SUPPRESS,
                               metavar=f.metadata.get("metavar", "PATH"), help=help_text)
        return
    parse = f.metadata.get("parse")
    if parse is None and kind not in _TYPES:
        raise TypeError(f"option {flag}: field {f.name} of type {f.type!r} needs a parse= function")
    if default is not None:
        help_text += f" (default: {default})"
    choices = f.metadata.get("choices")
    metavar = None if choices else f.metadata.get("metavar", _METAVARS.get(kind, "TEXT"))
    container.add_argument(flag, dest=dest, type=str if parse else _TYPES[kind], default=argparse.SUPPRESS,
                           choices=choices, metavar=metavar, help=help_text)


def add_options(parser: argparse.ArgumentParser, job_cls) -> None:
    """One option per option field of dataclass ``job_cls``: its plain fields in the parser's
    own section, each component's in a section titled by the component field's docstring (else
    the component class's)."""
    docs = field_docs(job_cls)
    for f in dataclasses.fields(job_cls):
        if f.metadata.get("component"):
            default = f.default_factory()
            cls = type(default)
            title = docs.get(f.name) or cls.__doc__.strip().split("\n")[0]
            group = parser.add_argument_group(title.rstrip("."))
            cls_docs = field_docs(cls)
            for g in _options(f, cls):
                _add_option(group, g, getattr(default, g.name), f"{f.name}.{g.name}", cls_docs.get(g.name, ""))
        elif f.metadata.get("cli", True):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            _add_option(parser, f, default, f.name, docs.get(f.name, ""))


class Parser(argparse.ArgumentParser):
    """The command line's ArgumentParser (its subcommands' too): a negative number such as -1e-3
    is a value, as in argparse of Python 3.13 (before, only -1 and -0.5 were: ``--lr -1e-3`` failed
    with "expected one argument" instead of saying what is wrong with the value)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-\.?\d")  # 3.13's; no option here starts so


def one_line_error(prog: str, hint: str = ""):
    """A ``parser.error`` that prints ``{prog}: error: {message}{hint}`` on one line of stderr and exits
    with status 2 (argparse's own prints the whole usage first)."""
    def error(message: str):
        print(f"{prog}: error: {message}{hint}", file=sys.stderr)
        sys.exit(2)
    return error


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type's name when it has none): what a one-line error
    quotes of a library's exception."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _value(f: dataclasses.Field, given):
    parse = f.metadata.get("parse")
    return parse(given, flag_of(f)) if parse is not None and isinstance(given, str) else given


def from_args(job_cls, args: argparse.Namespace):
    """The ``job_cls`` instance of options parsed by a parser made with ``add_options``: each
    component is its default instance with the given options replaced. Bad values raise ConfigError
    with one line naming the flag."""
    given = vars(args)
    values = {}
    try:
        for f in dataclasses.fields(job_cls):
            if f.metadata.get("component"):
                default = f.default_factory()
                cls = type(default)
                parts = {g.name: getattr(default, g.name) for g in dataclasses.fields(cls) if g.init}
                for g in _options(f, cls):
                    if f"{f.name}.{g.name}" in given:
                        parts[g.name] = _value(g, given[f"{f.name}.{g.name}"])
                values[f.name] = cls(**parts)
            elif f.name in given and f.metadata.get("cli", True):
                values[f.name] = _value(f, given[f.name])
        return job_cls(**values)
    except ConfigError as e:
        raise ConfigError(e.on_command_line()) from None


def given_options(job_cls, args: argparse.Namespace) -> frozenset[str]:
    """The option fields of ``job_cls`` given on the command line ``args`` was parsed from (a parser
    made with ``add_options`` leaves the others out), as ``component.field`` (or ``field``) names."""
    names = set()
    for f in dataclasses.fields(job_cls):
        if f.metadata.get("component"):
            names.update(f"{f.name}.{g.name}" for g in _options(f, type(f.default_factory())))
        elif f.metadata.get("cli", True):
            names.add(f.name)
    return frozenset(names & set(vars(args)))


# ---- values written as text

_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str, flag: str) -> int:
    """Bytes from '12e9', '8G' / '8GB' (powers of 1000) or '8GiB' (powers of 1024); ConfigError
    naming ``flag`` otherwise."""
    t = text.strip().lower().removesuffix("b")
    unit = next((u for u in sorted(_BYTE_UNITS, key=len, reverse=True) if u and t.endswith(u)), "")
    try:
        value = float(t[:len(t) - len(unit)] if unit else t) * _BYTE_UNITS[unit]
    except ValueError:
        raise ConfigError(f"{flag} must be a size in bytes like 12e9, 8G or 8GiB, got {text!r}") from None
    if not value >= 1:
        raise ConfigError(f"{flag} must be at least 1 byte, got {text!r}")
    return int(value)
