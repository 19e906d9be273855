"""The training loop of ``pystronghold train``: data, model, window engine, schedule, metrics,
validation, checkpoints and trace outputs.

``Trainer(resolve(config))`` builds everything from the run ``train.run.resolve`` decided (bad
input was refused there, before any long work); ``trainer.train()`` runs the remaining steps and
returns a ``TrainResult``. Library code: progress goes to the ``on_step`` callback (the CLI draws a
tqdm bar), text to ``logging``.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

import torch

from pystronghold.data import BatchSampler, validation_batches
from pystronghold.lr_schedule import warmup_cosine
from pystronghold.optim.hyper import AdamW
from pystronghold.parallel.data import any_rank
from pystronghold.tokenized import training_corpus
from pystronghold.train.build import build_engine, build_model, load_hf_model
from pystronghold.train.checkpoint_dir import new_run_id, open_run_directory_on_rank_0, prune_checkpoints
from pystronghold.train.checkpoint_state import run_record, run_state
from pystronghold.train.metrics import IntervalMetrics, MetricsWriter, TrainResult, memory_report, summarize_events
from pystronghold.train.run import Run
from pystronghold.train.step import Stepper

__all__ = ["Trainer", "seed_everything"]

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's (and numpy's, when installed) generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


class Trainer:
    """One training run of a GPT through the window runtime, built from its ``Run``."""

    def __init__(self, run: Run) -> None:
        self.run, self.config = run, run.config  # the options, read only
        # Several processes (torchrun): the TP x DP groups first (sizes were checked on every rank).
        # Every rank seeds alike, so all draw the same global batches and build the single-process
        # weights (each TP rank keeps its shard); DP rank r trains on slice r.
        self.groups = None
        par = run.config.parallel
        if par.distributed:
            from pystronghold.parallel import init_parallel

            backend = "nccl" if run.runtime.device.startswith("cuda") else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(torch.device(run.runtime.device))
            self.groups = init_parallel(par.tp, par.dp_size, pp=par.pp, heads=run.model.heads, backend=backend,
                                        timeout_s=par.dist_timeout)
        self.rank = self.groups.rank if self.groups is not None else 0
        # NOTE: before anything long: a directory another run holds, or a fresh run's refusal. Here,
        # not in resolve(): rank 0 holds the lock for the run's length and tells the other ranks
        # through the process group
        ck = run.config.checkpoint
        self.checkpoint_lock, resume_from = None, None
        if ck.checkpoint_dir:
            self.checkpoint_lock, resume_from = open_run_directory_on_rank_0(
                ck.checkpoint_dir, resume=ck.resume, overwrite=ck.overwrite, rank=self.rank,
                shared=self.groups is not None)
        try:
            self._build(resume_from)
        except BaseException:
            self.release_checkpoint_dir()
            raise

    def _build(self, resume_from: Path | None) -> None:
        """Data, model, engine and schedule; then the checkpoint ``resume_from`` is loaded."""
        run, cfg = self.run, self.run.model
        opts, data = run.config.run, run.config.data
        seed_everything(opts.seed)
        # the model's files are checked (headers only) before the text is tokenized
        hf_model = load_hf_model(run, self.groups) if run.hf else None
        self.corpus = training_corpus(list(data.data), vocab_size=cfg.vocab_size, max_bytes=data.max_bytes,
                                      val_fraction=data.val_fraction, token_dtype=data.token_dtype,
                                      tokenizer_dir=cfg.source if run.hf else None)
        self.seq, self.batch = run.seq, data.batch
        if run.seq_why is not None:
            log.info("seq: %d tokens (%s)", self.seq, run.seq_why)
        self.sampler = BatchSampler(self.corpus.train, self.batch, self.seq, seed=opts.seed,
                                    labels=self.corpus.train_labels)
        self.val = validation_batches(self.corpus.val, self.batch, self.seq, opts.eval_batches,
                                      labels=self.corpus.val_labels)
        parts = build_model(run, self.groups, hf_model)
        self.model, self.lora = parts.model, parts.lora
        self.auto_window = None
        split = {}
        if run.runtime.window == "auto":  # NOTE: measured on the built model's blocks, so decided here
            from pystronghold.train.autowindow import choose_runtime_window

            self.auto_window = choose_runtime_window(self.model, run, parts.blocks)
            split = self.auto_window.wrap_options()
        o = run.config.optim
        # NOTE: the run's RuntimeConfig, plus what only exists now: W, K and the resident recompute the
        # planner chose, the process groups, the AdamW of OptimOptions; the trace feeds the metrics.
        runtime = dataclasses.replace(
            run.runtime, trace=True, parallel=self.groups, **split,
            optimizer=AdamW(lr=run.lr, betas=(0.9, o.beta2), weight_decay=o.weight_decay, decay=o.decay))
        self.engine, self.pipeline = build_engine(run, parts, runtime, self.groups)
        self.scheduler = warmup_cosine(self.engine.optimizer, warmup_steps=min(o.warmup, opts.steps),
                                       decay_steps=max(opts.steps, 1), min_ratio=o.min_lr_ratio)
        origin = "--lr" if o.lr is not None else "LoRA's default" if self.lora else "the model's default"
        log.info("AdamW: peak lr %g (%s), %d warm-up steps, cosine to %g x peak", run.lr, origin,
                 min(o.warmup, opts.steps), o.min_lr_ratio)
        par = run.config.parallel
        uneven = None  # --dp-split: this replica's share of every batch and its loss weight
        if par.dp_split is not None and self.groups is not None and self.groups.dp_size > 1:
            from pystronghold.train.uneven import UnevenBatch

            uneven = UnevenBatch(sizes=par.dp_split, dp_rank=self.groups.dp_rank)
        self.stepper = Stepper(engine=self.engine, scheduler=self.scheduler, groups=self.groups,
                               pipeline=self.pipeline, uneven=uneven, hf_model=self.model if run.hf else None,
                               loss_chunk=run.loss_chunk_tokens, accumulation=run.runtime.accumulation_steps)
        self.step = 0
        self.lineage = [new_run_id()]
        """Run ids of the runs this one continues, its own last (recorded in its checkpoints)."""
        self.result = TrainResult()
        self._all_events: list = []  # kept only with --trace
        self.stop_requested: str | None = None
        """Set (to a signal's name) from outside, e.g. a signal handler: the run stops after the step
        in progress, writing a checkpoint when --checkpoint-dir is set."""
        if resume_from is not None:
            from pystronghold.train.resume import resume

            resume(self, resume_from)
        self.result.start_step = self.step

    def checkpoint_state(self):
        """What a checkpoint of this run saves and loads: ``(state objects, RunRecord)`` at this step
        (``checkpoint_state.run_state`` and ``run_record``)."""
        state = run_state(self.run, engine=self.engine, scheduler=self.scheduler, sampler=self.sampler,
                          groups=self.groups, pipeline=self.pipeline)
        return state, run_record(self.run, step=self.step, lineage=self.lineage, model=self.engine.model,
                                 lora=self.lora)

    def release_checkpoint_dir(self) -> None:
        """Give up the --checkpoint-dir lock (rank 0; ``close`` does it)."""
        if self.checkpoint_lock is not None:
            self.checkpoint_lock.release()

    # ---- one step

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of inputs ``x`` against shifted targets ``y`` (B, T) through the engine."""
        return self.stepper.loss(x, y)

    def train_step(self) -> float:
        """One optimizer step (``accumulation`` micro-batches); returns the mean micro-batch loss."""
        loss = self.stepper.train_step(self.sampler)
        self.step += 1
        return loss

    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches (the same value on every rank)."""
        return self.stepper.evaluate(self.val)

    # ---- the run

    def train(self, on_step=None) -> TrainResult:
        """Run the remaining steps (or until ``stop_requested``). ``on_step(step, loss)`` is called
        after each step (progress)."""
        run, res, tracer = self.config.run, self.result, self.engine.trace
        tracer.clear()
        writer = MetricsWriter(run.metrics_file, run.tensorboard, resumed_step=self.result.start_step) \
            if self.rank == 0 else MetricsWriter(None, None)
        try:
            self._run_steps(res, writer, on_step)
        finally:
            writer.close()
        res.memory = memory_report(self.engine)
        if run.trace and self.rank == 0:
            self._write_trace(Path(run.trace))
        return res

    def _run_steps(self, res: TrainResult, writer: MetricsWriter, on_step) -> None:
        run, ck = self.config.run, self.config.checkpoint
        tracer = self.engine.trace
        tokens_per_step = self.config.runtime.accumulation_steps * self.batch * self.seq
        interval_losses: list[float] = []
        t_interval = time.perf_counter()
        steps_in_interval = 0
        skipped_before = self.engine.skipped_steps  # at the start of the run, then of the interval
        skipped_at_start = skipped_before
        while self.step < run.steps:
            t0 = time.perf_counter()
            loss = self.train_step()
            res.time.wall_s += time.perf_counter() - t0
            res.losses.append((self.step, loss))
            res.skipped_steps = self.engine.skipped_steps - skipped_at_start
            interval_losses.append(loss)
            steps_in_interval += 1
            if on_step is not None:
                on_step(self.step, loss)
            last = self.step == run.steps
            validate = bool(run.eval_every and self.step % run.eval_every == 0) or last
            drain = validate or bool(ck.checkpoint_dir and ck.checkpoint_every and self.step % ck.checkpoint_every == 0)
            if self.step % run.log_every == 0 or last:
                t0 = time.perf_counter()
                # NOTE: a log waits for the device and the copies (the loss, the time), not for the host
                # updates, which overlap the next forward; they are drained before validation, a
                # checkpoint and the end. What is waited for is training time too: on an H100 leaving
                # it out made the summary's mean 882 ms/step for 1526
                self.engine.synchronize(updates=drain)
                res.time.wall_s += time.perf_counter() - t0
                elapsed = time.perf_counter() - t_interval
                events = tracer.events()
                tracer.clear()
                if run.trace:
                    self._all_events += events
                s = summarize_events(events)
                res.time.add(s)
                m = IntervalMetrics.of(self.engine, s, step=self.step, losses=interval_losses, elapsed_s=elapsed,
                                       tokens=tokens_per_step * steps_in_interval,
                                       skipped_steps=self.engine.skipped_steps - skipped_before)
                skipped_before = self.engine.skipped_steps
                res.intervals.append(m)
                log.info("%s", m.line())
                if self.auto_window is not None and len(res.intervals) == 1:
                    log.info("%s", self.auto_window.peak_line(m.device_peak_bytes, self.step - res.start_step,
                                                              cuda=self.engine.device.type == "cuda"))
                writer.interval(m)
                interval_losses, steps_in_interval = [], 0
            if validate:
                t0 = time.perf_counter()
                self.engine.synchronize()  # the host updates land before the untraced validation
                res.time.wall_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                # NOTE: untraced: validation is timed apart (eval_s), and its compute and host spans
                # would otherwise be counted as training time in the next interval's summary
                traced, tracer.enabled = tracer.enabled, False
                try:
                    res.val_losses.append((self.step, self.evaluate()))
                finally:
                    tracer.enabled = traced
                res.time.eval_s += time.perf_counter() - t0
                log.info("step %d | validation loss %.4f", self.step, res.val_losses[-1][1])
                writer.validation(*res.val_losses[-1])
            # NOTE: all ranks stop after the same step, or a collective of the next one would hang
            stop = any_rank(self.stop_requested is not None)
            if ck.checkpoint_dir and ((ck.checkpoint_every and self.step % ck.checkpoint_every == 0) or last
                                      or stop):
                from pystronghold.train.checkpoint import save_checkpoint

                t0 = time.perf_counter()
                # NOTE: every rank calls it: the TP ranks of DP replica 0 gather the split tensors,
                # rank 0 writes; all wait so that no rank runs ahead of a checkpoint being written.
                state, record = self.checkpoint_state()
                written = save_checkpoint(state, ck.checkpoint_dir, record)
                if written is not None:
                    res.checkpoints.append(str(written))
                    deleted = prune_checkpoints(ck.checkpoint_dir, keep=ck.keep, lineage=self.lineage,
                                                written=written, overwrite=ck.overwrite)
                    res.checkpoints = [c for c in res.checkpoints if Path(c) not in deleted]  # what --keep left
                self.stepper.barrier()
                res.time.checkpoint_s += time.perf_counter() - t0
            if self.step % run.log_every == 0 or last:
                t_interval = time.perf_counter()  # validation and checkpoints are not step time
                if drain:  # their spans go; a host update still running would lose its own
                    tracer.clear()
            if stop:
                res.stopped_by = self.stop_requested or "a signal on another rank"
                return

    def _write_trace(self, out: Path) -> None:
        from pystronghold.train.pictures import write_outputs

        self.result.outputs += [str(p) for p in write_outputs(out, self._all_events, self.result, unit=self.corpus.unit)]

    def close(self, *, keep_process_group: bool = False) -> None:
        """Stop the engine's worker threads, release the checkpoint directory and leave
        torch.distributed (when this run joined it, unless ``keep_process_group``)."""
        try:
            self.engine.close()
        finally:
            self.release_checkpoint_dir()
            if not keep_process_group:
                close_parallel()


def close_parallel() -> None:
    """Destroy the default process group, if any (the end of a run, or its failure)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
