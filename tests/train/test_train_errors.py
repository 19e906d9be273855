"""Errors that used to mislead: a --host-memory limit read as what the host has, --nvme directories
accepted without a check, `plan --gpu nosuch` blamed on another option, and a plan that did not say
why the disk was (or was not) used. Each is one line and exit status 2."""

from __future__ import annotations

import logging
import os
import re

import pytest

from pystronghold.cli import main
from pystronghold.io.scratch import check_io_directory

TRAIN = ["train", "--model", "tiny", "--steps", "1", "--batch", "2", "--seq", "16", "--eval-batches", "1",
         "--quiet"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _text(tmp_path) -> str:
    text = tmp_path / "t.txt"
    text.write_text("hello world, a few bytes of training text\n" * 400)
    return str(text)


def test_host_memory_limit_is_named_as_the_users_limit_with_what_the_host_has(capsys, tmp_path):
    assert main(TRAIN + ["--data", _text(tmp_path), "--host-memory", "1K"]) == 2
    err = _one_line(capsys)
    assert re.search(r"the host memory limit you set \(--host-memory / host_memory_bytes=\) is 1,000 bytes "
                     r"\(0\.000 GiB\); the host has [\d,]+ bytes \([\d.]+ GiB\) available", err), err
    assert "Raise the limit" in err


def test_nvme_that_takes_no_files_is_refused_at_the_start(capsys):
    assert main(TRAIN + ["--nvme", "/proc"]) == 2  # before the data is read or anything is built
    err = _one_line(capsys)
    assert "--nvme /proc: cannot write and read back a file there" in err


def test_a_missing_nvme_directory_is_created_and_said_so(tmp_path, caplog):
    target = tmp_path / "new" / "nvme"
    with caplog.at_level(logging.WARNING, logger="pystronghold.io.scratch"):
        check_io_directory(target, flag="--nvme")
    assert target.is_dir() and os.listdir(target) == []  # the probe file is gone
    assert f"--nvme {target} did not exist: created it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pystronghold.io.scratch"):
        check_io_directory(target, flag="--nvme")
    assert "created" not in caplog.text


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_nvme_directory_is_one_line(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert main(TRAIN + ["--nvme", str(ro)]) == 2
    assert f"--nvme {ro}: cannot write and read back a file there" in _one_line(capsys)


def test_wrap_checks_nvme_dir_even_when_nothing_spills():
    import pystronghold as ph
    from runtime_models import HetStack

    model = HetStack()
    with pytest.raises(ValueError, match="nvme_dir= /proc: cannot write and read back a file there"):
        ph.wrap(model, blocks=model.blocks, nvme_dir="/proc")


def test_plan_reports_an_unknown_gpu_before_missing_options(capsys):
    assert main(["plan", "--gpu", "nosuch"]) == 2
    err = _one_line(capsys)
    assert "unknown GPU 'nosuch'" in err and "--host-memory" not in err


@pytest.mark.parametrize("host,words", [
    (64, "NVMe tier used: the store needs 96.0 GiB per rank, more than the 56.0 GiB of host memory"),
    (640, "NVMe tier not used: the store needs 96.0 GiB per rank, which fits the 632.0 GiB of host memory"),
    (9, "NVMe tier not enough: the store needs 96.0 GiB per rank, more than the 1.0 GiB of host memory")])
def test_plan_says_why_the_disk_was_or_was_not_used(capsys, host, words):
    # every block streamed (K=0): with K chosen, resident blocks would shrink the host store
    main(["plan", "--gpu", "h100-80gb", "--host-memory", str(host), "--model", "gpt3-6.7b", "--nvme", "4000",
          "--resident-blocks", "0"])
    assert words in capsys.readouterr().out


def test_timeline_title_and_run_summary_name_their_figures_apart():
    from pystronghold.runtime.tracing.trace import Tracer
    from pystronghold.train.metrics import TimeReport
    from pystronghold.train.pictures import timeline_title

    tracer = Tracer(enabled=True)
    tracer.record("compute_fwd", 0, 0.0, 1.0, 0)
    tracer.record("h2d", 1, 0.5, 1.5, 100)  # half of the copy overlaps compute
    title = timeline_title(3, 2, tracer.summary())
    assert title.startswith("last 3 steps, W=2: in these steps 50% of copy and host-update time overlapped "
                            "compute"), title
    report = TimeReport(wall_s=2.0, kind_s={"h2d": 1.0}, hidden_s=0.25, background_s=1.0)
    background = next(s for s in report.lines() if s.startswith("background"))
    assert background.endswith("over the whole run 25% of this background work was hidden behind compute")
    assert "overlap" not in background and "hidden" not in title


def test_timeline_step_markers_follow_the_optimizer_steps_not_block_0():
    """Block 0 resident (never traced) and two micro-batches per step: each step starts with its
    first host span after the previous optimizer step."""
    from pystronghold.runtime.tracing.trace import Tracer
    from pystronghold.train.pictures import step_starts

    tracer = Tracer(enabled=True)
    for t in (1.0, 2.0, 3.0):
        for micro in (0.0, 0.4):  # each micro-batch: the model's code (resident block 0), block 1
            tracer.record("model", None, t + micro, t + micro + 0.1)
            tracer.record("compute_fwd", 1, t + micro + 0.1, t + micro + 0.2)
            tracer.record("compute_bwd", 1, t + micro + 0.2, t + micro + 0.3)
        tracer.record("step", None, t + 0.8, t + 0.9)
    events = tracer.events()
    assert step_starts(events, [4, 5, 6, 7]) == [(5, 1.0), (6, 2.0), (7, 3.0)]
    assert step_starts(events, [7]) == [(7, 3.0)]


def test_bad_paths_and_values_of_options_are_config_errors_from_python_too(tmp_path):
    """The checks made without an option object at hand (a path given by a flag, a flag's text) raise
    the one error type of bad options, so a caller of the Python API catches them as the CLI does."""
    from pystronghold.options import ConfigError
    from pystronghold.train.output_paths import check_creatable_file

    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        check_io_directory(a_file, flag="--nvme")
    with pytest.raises(ConfigError, match="not a writable file"):
        check_creatable_file("--metrics", str(tmp_path))
