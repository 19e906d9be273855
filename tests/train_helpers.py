"""Small configurations for the `pystronghold train` tests (a 4-block GPT on a few KiB of text)."""

from __future__ import annotations

import json
from pathlib import Path

from pystronghold.runtime.config import RuntimeConfig
from pystronghold.train import Trainer, resolve
from pystronghold.train.config import CheckpointOptions, DataOptions, ModelOptions, OptimOptions, RunOptions, TrainConfig

TINY = {"vocab_size": 256, "seq_len": 32, "layers": 4, "hidden": 32, "heads": 2}


def text_dir(root: Path) -> Path:
    """A directory of deterministic text (about 40 KiB of Python-like lines)."""
    d = root / "text"
    d.mkdir(exist_ok=True)
    for i in range(4):
        lines = [f"def f{i}_{k}(x):\n    return x * {k} + {i}  # line {k}\n" for k in range(200)]
        (d / f"m{i}.py").write_text("".join(lines))
    return d


def tiny_config(tmp_path: Path, *, steps: int = 6, window: int | str = 2, ckpt: str | None = None,
                every: int = 0, resume: bool = False, clip: float | None = 1.0, precision: str = "fp32",
                trace: str | None = None, model: dict | None = None, accumulation: int = 1,
                resident: int = 0) -> TrainConfig:
    model_file = tmp_path / "model.json"
    model_file.write_text(json.dumps(model or TINY))
    return TrainConfig(
        model=ModelOptions(model=str(model_file)),
        data=DataOptions(data=[str(text_dir(tmp_path))], max_bytes=1 << 16, batch=4, seq=32),
        optim=OptimOptions(lr=3e-3, warmup=2),
        runtime=RuntimeConfig(window=window, precision=precision, resident_blocks=resident, clip_grad_norm=clip,
                              accumulation_steps=accumulation),
        run=RunOptions(steps=steps, log_every=2, eval_every=0, eval_batches=2, trace=trace, quiet=True),
        checkpoint=CheckpointOptions(checkpoint_dir=ckpt, checkpoint_every=every, resume=resume))


def listing(ck: Path) -> list[str]:
    """The names in checkpoint directory ``ck`` but its run marker (``checkpoint_dir.RUN_FILE``), sorted."""
    from pystronghold.train.checkpoint_dir import RUN_FILE

    return sorted(p.name for p in Path(ck).iterdir() if p.name != RUN_FILE)


def save_trainer(trainer, root, **options):
    """``save_checkpoint`` of ``trainer``'s state objects at its step, as its loop saves them."""
    from pystronghold.train.checkpoint import save_checkpoint

    state, record = trainer.checkpoint_state()
    return save_checkpoint(state, root, record, **options)


def run_training(config: TrainConfig, *, keep: bool = False):
    """Train ``config`` to the end and close the trainer. Returns the ``TrainResult``, or with ``keep``
    the (closed) ``Trainer`` itself, for a test that reads its engine afterwards."""
    trainer = Trainer(resolve(config))
    try:
        result = trainer.train()
    finally:
        trainer.close()
    return trainer if keep else result


def cli_error(capsys, argv: list[str]) -> str:
    """The one line ``pystronghold argv`` prints on stderr when it refuses its input (exit status 2)."""
    from pystronghold.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def kill_when_marked(script: str, marker: Path, what: str, timeout_s: float = 120.0, *, sig: int | None = None,
                     stderr: Path | None = None) -> int:
    """Run ``script`` in a child Python; send it ``sig`` (default SIGKILL) as soon as it writes
    ``marker``. ``what`` names the point the child must reach (in the failure message). The child's
    stderr goes to the file ``stderr`` when given. Returns the child's exit status."""
    import os
    import signal
    import subprocess
    import sys
    import time

    err = open(stderr, "w") if stderr is not None else None
    child = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, OMP_NUM_THREADS="1"),
                             stderr=err)
    try:
        deadline = time.monotonic() + timeout_s
        while not marker.exists():
            assert child.poll() is None, f"the child exited before {what}"
            assert time.monotonic() < deadline, f"the child did not reach {what} in {timeout_s} s"
            time.sleep(0.1)
        child.send_signal(signal.SIGKILL if sig is None else sig)
        return child.wait(timeout=timeout_s)  # TimeoutExpired: the signal did not end it
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        if err is not None:
            err.close()
