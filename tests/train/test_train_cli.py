"""`pystronghold train`: the shortened demo end to end, metrics lines, bad inputs, trace outputs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from pystronghold.cli import main
from pystronghold.train import Trainer, resolve
from pystronghold.train.metrics import METRIC_FIELDS
from train_helpers import run_training, text_dir, tiny_config

ENV = dict(os.environ, OMP_NUM_THREADS="2")


def test_demo_shortened_runs_end_to_end_in_a_subprocess():
    """The demo configuration itself (12 blocks, W=2, stdlib text), 3 steps, as `make demo` runs it."""
    proc = subprocess.run([sys.executable, "-m", "pystronghold", "train", "--steps", "3", "--log-every", "1",
                           "--eval-batches", "1", "--max-bytes", "200000", "--quiet"],
                          capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [s for s in proc.stdout.splitlines() if s.startswith("step ") and "| loss" in s]
    assert len(lines) == 3
    for line in lines:  # fixed fields, in order
        names = [part.strip().rsplit(" ", 1)[0] if not part.strip().startswith(("step", "loss")) else
                 part.strip().split(" ")[0] for part in line.split("|")]
        assert [n.split(" ")[0] for n in names] == [f.split(" ")[0] for f in METRIC_FIELDS], line
    out = proc.stdout
    assert "window W=2 of 12 blocks" in out and "resident model would need" in out
    assert "host store: master" in out and "compute" in out


def test_loss_falls_and_metrics_are_filled(tmp_path):
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=30)))
    try:
        res = trainer.train()
    finally:
        trainer.close()
    first = sum(v for _, v in res.losses[:3]) / 3
    last = sum(v for _, v in res.losses[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert [s for s, _ in res.losses] == list(range(1, 31))
    m = res.intervals[-1]
    assert m.h2d_gbps > 0 and m.d2h_gbps > 0
    assert m.host_bytes == trainer.engine.memory_report().host_store_bytes
    mem = res.memory
    assert mem.window == 2 and mem.blocks == 4
    assert mem.head_tail_bytes < mem.device_peak_bytes <= mem.window_bytes + mem.head_tail_bytes
    assert mem.resident_bytes > mem.window_bytes
    assert res.val_losses and res.val_losses[-1][0] == 30


def test_help_lists_every_option_with_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for flag in ("--window", "--precision", "--batch", "--seq", "--steps", "--lr", "--warmup", "--clip",
                 "--accumulation", "--seed", "--device", "--trace", "--checkpoint-dir", "--checkpoint-every",
                 "--resume", "--data", "--model"):
        assert flag in out, flag
    assert "examples:" in out and "pystronghold train --model tiny --window auto" in out


def _bad(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["train", *argv]))
    err = capsys.readouterr().err.strip()
    return exc.value.code, err


@pytest.mark.parametrize("argv, words", [
    (["--model", "nope"], "unknown preset"),
    (["--window", "0"], "--window must be >= 1"),
    (["--window", "two"], "--window must be"),
    (["--data", "/no/such/dir"], "no such file or directory"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "--device"),
    (["--device", "tpu"], "--device must be"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--overwrite"], "--overwrite needs --checkpoint-dir"),
    (["--overwrite", "--resume", "--checkpoint-dir", "ck"], "--overwrite starts a fresh run, --resume continues one"),
    (["--bogus"], "unrecognized arguments"),
    (["--model", "gpt3-175b"], "GiB of host memory"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--lr", "inf"], "--lr must be > 0 and finite, got inf"),
    (["--lr", "nan"], "--lr must be > 0 and finite, got nan"),
    (["--lr", "-1e-3"], "--lr must be > 0 and finite, got -0.001"),  # a value, not an option
    (["--lr", "-.5"], "--lr must be > 0 and finite, got -0.5"),
    (["--weight-decay", "inf"], "--weight-decay must be >= 0 and finite, got inf"),
    (["--seed", "-1e3"], "argument --seed: invalid int value: '-1e3'"),
    (["--batch", "1000000000000"], "--batch 1000000000000 x --seq 128 (with --eval-batches 4): the batches "
                                   "and activations need at least "),  # it grew memory until killed
    (["--eval-batches", "100000000000"], "(with --eval-batches 100000000000): the batches"),
])
def test_bad_input_is_one_line(capsys, argv, words):
    code, err = _bad(capsys, argv)
    assert code == 2
    assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--trace", "--metrics-file", "--tensorboard"])
def test_an_output_path_under_a_file_is_refused_before_the_run(capsys, tmp_path, flag):
    if flag == "--tensorboard" and importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed (the option is refused for that first)")
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" / "out"
    code, err = _bad(capsys, [flag, str(out), "--model", "tiny", "--steps", "1", "--max-bytes", "65536"])
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"pystronghold train: error: {flag} {out}: ") and "not a writable" in err, err


def test_unwritable_checkpoint_dir(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        code, err = _bad(capsys, ["--checkpoint-dir", str(locked / "ck")])
    finally:
        locked.chmod(0o700)
    assert code == 2 and "not a writable directory" in err and len(err.splitlines()) == 1


def test_bad_input_in_a_real_subprocess(tmp_path):
    """No traceback reaches the user: a missing data path and `--device cuda` where there is none."""
    device = ["--device", "cuda:99"]
    for argv in (["--data", str(tmp_path / "missing")], device):
        proc = subprocess.run([sys.executable, "-m", "pystronghold", "train", *argv], capture_output=True,
                              text=True, timeout=120, env=ENV)
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("pystronghold train: error:")


def test_trace_writes_perfetto_json_and_pictures(tmp_path):
    out = tmp_path / "trace"
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=4, trace=str(out))))
    try:
        res = trainer.train()
    finally:
        trainer.close()
    data = json.loads((out / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "h2d", "d2h", "optimizer"} <= lanes
    for name in ("timeline.png", "loss.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out / "loss.png") in res.outputs


def test_train_with_nvme_reports_the_tier_and_bad_nvme_input_is_one_line(tmp_path, capsys, caplog):
    import logging

    from pystronghold.cli import main
    from pystronghold.options import parse_bytes

    assert parse_bytes("8G", "--x") == 8 * 10**9 and parse_bytes("1.5GiB", "--x") == 3 * 2**29
    assert parse_bytes("12e9", "--x") == 12 * 10**9 and parse_bytes("512MB", "--x") == 512 * 10**6
    text = tmp_path / "t.txt"
    text.write_text("hello world, a few bytes of training text\n" * 400)
    base = ["train", "--model", "tiny", "--data", str(text), "--steps", "2", "--batch", "2", "--seq", "16",
            "--log-every", "1", "--eval-batches", "1", "--quiet"]
    caplog.set_level(logging.INFO)
    assert main(base + ["--nvme", str(tmp_path / "nvme"), "--nvme-states", "all"]) == 0
    assert "NVMe tier" in caplog.text and "exp_avg_sq on disk" in caplog.text
    # --window auto measures a block of the lazily built model (its blocks start on meta)
    assert main(base + ["--nvme", str(tmp_path / "nvme"), "--window", "auto", "--steps", "1"]) == 0
    capsys.readouterr()
    (tmp_path / "afile").write_text("x")
    for extra, message in ((["--nvme", str(tmp_path / "afile")], "not a directory"),
                           (["--host-memory", "lots"], "--host-memory must be a size"),
                           (["--nvme-states", "all"], "--nvme-states all needs --nvme")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_timeline_pictures_the_last_steps_with_a_resident_block_0(tmp_path, monkeypatch):
    """Block 0 resident, two micro-batches per step: the picture still shows the last 3 steps, each
    marked where it starts."""
    from pystronghold.train import pictures

    drawn = {}

    def draw(tracer, path, *, title=None, steps=None):
        drawn.update(title=title, steps=steps, first_s=min(e.start_s for e in tracer.events()))
        return path

    monkeypatch.setattr(pictures.Tracer, "write_png", draw)
    run_training(tiny_config(tmp_path, steps=5, window=1, resident=1, accumulation=2, trace=str(tmp_path / "out")))
    assert drawn["title"].startswith("last 3 steps, W=1:"), drawn["title"]
    assert [k for k, _ in drawn["steps"]] == [3, 4, 5]
    starts = [s for _, s in drawn["steps"]]
    assert starts == sorted(starts) and starts[0] == drawn["first_s"]


EXIT_PROBE = """
import atexit, sys
atexit.register(lambda: print("finalized", flush=True))
sys.argv = ["pystronghold", *sys.argv[1:]]
from pystronghold.cli import run
run()
"""


@pytest.mark.parametrize("world_size", [None, "2"])
def test_a_rank_of_a_multi_process_run_leaves_without_finalizing_and_flushed(world_size):
    """Under torchrun (WORLD_SIZE > 1) the command leaves with os._exit once its output is flushed:
    during finalization a torch gloo worker that drops a finished collective's tensors is ended
    by pthread_exit, which aborts the process (a rank of a successful run died with SIGABRT).
    Its status is kept; a single process still finalizes as usual."""
    env = {k: v for k, v in ENV.items() if k != "WORLD_SIZE"}
    if world_size:
        env["WORLD_SIZE"] = world_size
    for argv, status in ((["info"], 0), (["plan", "--model", "no-such-preset"], 2)):
        p = subprocess.run([sys.executable, "-c", EXIT_PROBE, *argv], capture_output=True, text=True,
                           timeout=120, env=env)
        assert p.returncode == status, p.stderr[-2000:]
        assert (p.stdout + p.stderr).strip()  # what it printed reached the pipe
        assert ("finalized" in p.stdout) is (world_size is None)


def test_export_refuses_to_replace_a_file_without_overwrite(tmp_path, capsys):
    ck, out = tmp_path / "ck", tmp_path / "model.safetensors"
    run_training(tiny_config(tmp_path, steps=1, ckpt=str(ck)))
    out.write_bytes(b"a user's own file")
    assert main(["export", str(ck), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"pystronghold export: error: {out} exists (give --overwrite to replace it)", err
    assert out.read_bytes() == b"a user's own file"
    assert main(["export", str(ck), str(tmp_path), "--overwrite"]) == 2  # a directory is never replaced
    assert capsys.readouterr().err.strip() == f"pystronghold export: error: {tmp_path} is a directory"
    assert main(["export", str(ck), str(tmp_path / "hf"), "--hf", "--overwrite"]) == 2
    assert "--overwrite replaces an output file" in capsys.readouterr().err
    assert main(["export", str(ck), str(out), "--overwrite"]) == 0
    assert out.read_bytes()[:8] != b"a user's"


def _filled(root, what: str):
    """Fill the tmpfs ``root``: with files until none can be made (``what="inodes"``), or with one
    file until no byte can be written (``"bytes"``)."""
    import errno

    try:
        if what == "inodes":
            for i in range(10_000):
                (root / f"f{i}").touch()
        else:
            with open(root / "big", "wb") as f:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
        return root
    pytest.fail(f"{root} did not fill")


TINY_RUN = ["--model", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--max-bytes", "65536",
            "--eval-batches", "1", "--log-every", "1", "--quiet"]


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--trace", "--metrics-file", "--tensorboard"])
def test_an_output_path_where_no_file_can_be_made_is_refused_at_start(capsys, tmp_path, flag):
    """Permissions allow it, but no file can be made there (no inode left): refused in one line
    before the run (it failed at step 1, or after the last step)."""
    from tmpfs import small_tmpfs

    if flag == "--tensorboard" and importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed (the option is refused for that first)")
    with small_tmpfs(1 << 20, inodes=8) as root:
        if root is None:
            pytest.skip("needs root to mount a tmpfs")
        out = _filled(root, "inodes") / "out"
        code, err = _bad(capsys, [flag, str(out), *TINY_RUN, "--data", str(text_dir(tmp_path))])
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"pystronghold train: error: {flag} {out}: ") and "No space left on device" in err, err


@pytest.mark.parametrize("flag, words", [("--metrics-file", "writing step 1"),
                                         ("--trace", "writing the trace and pictures")])
def test_a_full_disk_under_an_output_names_the_option_and_the_path(capsys, tmp_path, flag, words):
    """The disk fills after start-up: the one line names the option and its path (it named neither,
    and the trace, written after the last step, a step that never ran)."""
    from tmpfs import small_tmpfs

    with small_tmpfs(1 << 20) as root:
        if root is None:
            pytest.skip("needs root to mount a tmpfs")
        out = _filled(root, "bytes") / "out"
        code, err = _bad(capsys, [flag, str(out), *TINY_RUN, "--data", str(text_dir(tmp_path))])
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err == f"pystronghold train: error: {flag} {out}: {words}: No space left on device", err
