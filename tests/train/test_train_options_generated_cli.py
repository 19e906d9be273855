"""`pystronghold.options`: argparse options generated from a job config's fields and their metadata
(flag, help, parse, negated switches, hidden fields, a subset of a component), the values built back
from the parsed arguments, and errors that name the flag."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import pytest

from pystronghold.options import ConfigError, add_options, component, from_args, option


def _flags(usage: str) -> list[str]:
    """The options of a usage line, in order (without --help)."""
    return [f for f in re.findall(r"\[(--[a-z0-9-]+)", usage) if f != "--help"]


@dataclass(kw_only=True, slots=True)
class Engine:
    """Engine settings."""

    speed: int = 3
    """Blocks per second."""
    size: int | None = option(None, flag="--size-bytes", parse=lambda text, flag: int(text) * 2, metavar="B")
    """Half the size."""
    fast: bool = option(True, flag="--slow", negated=True, help="Go slowly.")
    """Go fast."""
    secret: object = option(None, cli=False)
    """Not an option."""

    def __post_init__(self) -> None:
        if self.speed < 1:
            raise ConfigError(self, "speed", f"must be >= 1, got {self.speed}; see `size`")


@dataclass(kw_only=True, slots=True)
class Limits:
    """Limits of the job."""

    low: int = 0
    """Lowest."""
    high: int = 9
    """Highest (not an option of Job: it exposes only `low`)."""


@dataclass(kw_only=True, slots=True)
class Job:
    """A job."""

    name: str = "x"
    """The job's name."""
    engine: Engine = component(lambda: Engine(speed=5))
    """How the engine runs"""
    limits: Limits = component(Limits, only=("low",))


def _job(*argv):
    parser = argparse.ArgumentParser()
    add_options(parser, Job)
    return parser, from_args(Job, parser.parse_args(list(argv)))


def test_a_component_field_with_metadata_is_all_an_option_needs():
    parser, job = _job()
    assert job.engine.speed == 5 and job.engine.fast is True and job.limits.high == 9  # the instances' defaults
    assert _flags(parser.format_usage()) == ["--name", "--speed", "--size-bytes", "--slow", "--low"]
    _, job = _job("--size-bytes", "21", "--slow", "--name", "y", "--low", "2")
    assert job.engine.size == 42 and job.engine.fast is False and job.name == "y" and job.limits.low == 2
    help_text = " ".join(parser.format_help().split())
    assert "How the engine runs: --speed N Blocks per second. (default: 5)" in help_text
    assert "--slow Go slowly." in help_text and "secret" not in help_text


def test_a_new_field_becomes_an_option_without_other_changes():
    @dataclass(kw_only=True, slots=True)
    class Bigger(Engine):
        ratio: float = option(0.5, choices=None, help="A ratio.")

    @dataclass(kw_only=True, slots=True)
    class BiggerJob:
        engine: Bigger = component(Bigger)

    parser = argparse.ArgumentParser()
    add_options(parser, BiggerJob)
    assert from_args(BiggerJob, parser.parse_args(["--ratio", "0.25"])).engine.ratio == 0.25
    assert "A ratio. (default: 0.5)" in " ".join(parser.format_help().split())


def test_mechanism_errors_name_the_flag_and_refuse_unknown_types():
    with pytest.raises(ConfigError) as info:  # the one type of a bad option, on the command line too
        _job("--speed", "0")
    assert str(info.value) == info.value.on_command_line() == "--speed must be >= 1, got 0; see --size-bytes"
    with pytest.raises(ConfigError, match=r"^Engine.speed must be >= 1, got 0; see size$"):
        Engine(speed=0)

    @dataclass(kw_only=True, slots=True)
    class Odd:
        when: complex = 1j
        """A type argparse cannot read without parse=."""

    with pytest.raises(TypeError, match="--when.*needs a parse= function"):
        add_options(argparse.ArgumentParser(), Odd)

    @dataclass(kw_only=True, slots=True)
    class Renamed:
        engine: Engine = component(Engine, hide=("sped",))

    with pytest.raises(TypeError, match=r"Engine has no option field \['sped'\]"):
        add_options(argparse.ArgumentParser(), Renamed)


def test_a_check_without_an_option_object_raises_its_message_as_it_is():
    import pickle

    error = ConfigError("--tp 2: the model's heads do not divide")
    assert isinstance(error, ValueError) and error.config is None
    assert str(error) == error.on_command_line() == "--tp 2: the model's heads do not divide"
    assert str(pickle.loads(pickle.dumps(error))) == str(error)  # pickle rebuilds it from its args


@pytest.mark.parametrize("argv, line", [
    (["--bogus"], "pystronghold: error: the following arguments are required: command (see pystronghold --help)"),
    (["plan", "--layers", "x"], "pystronghold plan: error: argument --layers: invalid int value: 'x'"),
    (["train", "--steps", "x"], "pystronghold train: error: argument --steps: invalid int value: 'x'"),
    (["export", "ck"], "pystronghold export: error: the following arguments are required: output"),
])
def test_every_command_reports_a_bad_command_line_as_one_line_and_status_2(capsys, argv, line):
    from pystronghold.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line]
