"""The training loop of ``pystronghold train``: data, model, window engine, schedule, metrics,
validation, checkpoints and trace outputs.

``Trainer(config)`` builds everything (raising ``ValueError`` for bad input before any long work);
``trainer.train()`` runs the remaining steps and returns a ``TrainResult``. Library code: progress
goes to the ``on_step`` callback (the CLI draws a tqdm bar), text to ``logging``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from pathlib import Path

import torch

from pystronghold.data import IGNORE_INDEX, BatchSampler, validation_batches
from pystronghold.lr_schedule import warmup_cosine
from pystronghold.models import GPT
from pystronghold.models.hf import HFModelConfig
from pystronghold.models.hf_loss import chunked_causal_lm_loss
from pystronghold.models.hf_tiling import tile_mlps
from pystronghold.optim.hyper import AdamW
from pystronghold.runtime.api import wrap
from pystronghold.tokenized import training_corpus
from pystronghold.train.checkpoint_dir import new_run_id, open_run_directory_on_rank_0, prune_checkpoints
from pystronghold.train.checkpoint_state import run_record, run_state
from pystronghold.train.config import TrainConfig
from pystronghold.train.metrics import (IntervalMetrics, MetricsWriter, TrainResult, device_peak_bytes,
                                        memory_report, summarize_events)

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
    """One training run of a GPT through the window runtime."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        cfg = config.gpt
        self.hf = isinstance(cfg, HFModelConfig)  # --model hf:DIR: its own tokenizer, loaded lazily
        from pystronghold.models.presets import param_count
        from pystronghold.runtime.memory.placement import available_host_bytes

        # NOTE: the blocks are built by wrap() (materialize_blocks=False: in parallel threads, each
        # block dropped once the store holds it), so the fp32 model never exists whole; the store
        # does (a Hugging Face model's blocks are read from its shards the same way).
        # Without --nvme it must fit in host memory: refuse before allocating rather than be
        # killed by the OOM killer (with --nvme the store's placement checks the budget itself).
        need, avail = (0 if self.hf else param_count(cfg) * 16), available_host_bytes()
        if need > avail and config.runtime.nvme_dir is None:
            raise MemoryError(f"--model: {param_count(cfg) / 1e6:,.0f}M parameters need about "
                              f"{need / 2**30:.1f} GiB of host memory (the host store: fp32 weights and "
                              f"Adam moments, gradients), {avail / 2**30:.1f} GiB available; give --nvme "
                              "DIR to keep states on disk")
        config.check_batch_memory()
        # Several processes (torchrun): the TP x DP groups first (sizes were checked by TrainConfig on
        # every rank). Every rank seeds alike, so all draw the same global batches and build the
        # single-process weights (each TP rank keeps its shard); DP rank r trains on slice r.
        self.groups = None
        par = config.parallel
        if par.distributed:
            from pystronghold.parallel import init_parallel

            backend = "nccl" if config.runtime.device.startswith("cuda") else "gloo"
            if backend == "nccl" and config.runtime.device == "cuda":
                config.runtime.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            if backend == "nccl":
                torch.cuda.set_device(torch.device(config.runtime.device))
            self.groups = init_parallel(par.tp, par.dp_size, pp=par.pp, heads=cfg.heads, backend=backend,
                                        timeout_s=par.dist_timeout)
        self.rank = self.groups.rank if self.groups is not None else 0
        # NOTE: before anything long: a directory another run holds, or a fresh run's refusal
        ck = config.checkpoint
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
        config = self.config
        cfg, run, par = config.gpt, config.run, config.parallel
        seed_everything(run.seed)
        if self.hf:  # the model's files are checked (headers only) before the text is tokenized
            from pystronghold.models.hf import load_lazy

            hf_model = load_lazy(cfg.source)
            if cfg.tp_size > 1:  # each rank keeps its shard of the head and tail, and of each block as it is read
                from pystronghold.models.hf_tp import shard_hf_model

                shard_hf_model(hf_model, self.groups.tp_group)
        data = config.data
        self.corpus = training_corpus(list(data.data), vocab_size=cfg.vocab_size, max_bytes=data.max_bytes,
                                      val_fraction=data.val_fraction, token_dtype=data.token_dtype,
                                      tokenizer_dir=cfg.source if self.hf else None)
        self.seq, self.batch = config.seq, data.batch
        if self.hf and not data.seq:
            log.info("seq: %d tokens (%s)", self.seq, config.seq_default[1])
        self.sampler = BatchSampler(self.corpus.train, self.batch, self.seq, seed=run.seed,
                                    labels=self.corpus.train_labels)
        self.val = validation_batches(self.corpus.val, self.batch, self.seq, run.eval_batches,
                                      labels=self.corpus.val_labels)
        self.dp_size = self.groups.dp_size if self.groups is not None else 1
        self.dp_rank = self.groups.dp_rank if self.groups is not None else 0
        self.uneven = None  # --dp-split: this replica's share of every batch and its loss weight
        if par.dp_split is not None and self.dp_size > 1:
            from pystronghold.train.uneven import UnevenBatch

            self.uneven = UnevenBatch(sizes=par.dp_split, dp_rank=self.dp_rank)
        materialize = None
        self.loss_chunk = data.loss_chunk_tokens((cfg.vocab_size if self.hf else cfg.padded_vocab_size) // cfg.tp_size)
        """Tokens per chunk of the loss (``--loss-chunk``; 0: the full logits at once)."""
        tile = config.mlp_tile_tokens  # positions per MLP tile (--mlp-tile; 0: untiled)
        if self.hf:  # blocks always built one at a time from the shards (a model larger than the host)
            self.model, blocks, materialize = hf_model.model, hf_model.blocks, hf_model.materialize
            if tile:
                log.info("MLP: %d of %d blocks run over tiles of %d positions", tile_mlps(self.model, tile),
                         len(blocks), tile)
        else:
            if tile:
                log.info("MLP: every block runs over tiles of %d positions", tile)
            self.model = GPT(dataclasses.replace(cfg, mlp_tile_tokens=tile), seed=run.seed,
                             tp_group=self.groups.tp_group if self.groups is not None else None,
                             materialize_blocks=False)
            self.model.tail.loss_chunk_tokens = self.loss_chunk
            blocks = self.model.blocks
        self.lora = None
        """The LoRA adapters of a --lora-rank run (``models.lora.LoraSpec``, targets as PEFT resolved them)."""
        if config.finetune.lora_rank:  # PEFT wraps the model; its blocks stay ``blocks``
            from pystronghold.models.lora import add_lora

            self.model, self.lora = add_lora(hf_model if self.hf else self.model, config.finetune.lora, run.seed)
        if config.finetune.freeze is not None:
            from pystronghold.train.finetune import freeze_matching

            freeze_matching(self.model, config.finetune.freeze)
        from pystronghold.train.long_context import choose_long_context_settings

        long_context = choose_long_context_settings(config)  # --head-tail, --offload-activations auto
        self.auto_window = None
        split = {}
        if config.runtime.window == "auto":
            from pystronghold.train.autowindow import choose_runtime_window

            self.auto_window = choose_runtime_window(self.model, config, blocks, long_context)
            split = self.auto_window.wrap_options()
        o = config.optim
        # NOTE: the run's RuntimeConfig as the user gave it, plus what only exists now: the long-context
        # settings and W, K and the resident recompute the planner chose, the process groups, the
        # AdamW of OptimOptions; the trace feeds the metrics.
        runtime = dataclasses.replace(
            config.runtime, trace=True, parallel=self.groups, **long_context, **split,
            optimizer=AdamW(lr=config.lr, betas=(0.9, o.beta2), weight_decay=o.weight_decay, decay=o.decay))
        self.pipeline = None  # --pp > 1: this rank's stage (pystronghold.pipelining)
        if par.pp > 1 and self.hf:
            from pystronghold.pipelining import hf_pipeline

            self.pipeline = hf_pipeline(hf_model, self.model, self.groups, micro_batches=par.micro_batch_count,
                                        loss_chunk_tokens=self.loss_chunk, schedule=par.pp_schedule,
                                        chunks=par.pp_chunks, config=runtime)
            self.engine = self.pipeline.engine
        elif par.pp > 1:
            from pystronghold.pipelining import gpt_pipeline

            self.pipeline = gpt_pipeline(self.model, self.groups, seq=self.seq, micro_batches=par.micro_batch_count,
                                         schedule=par.pp_schedule, chunks=par.pp_chunks, config=runtime)
            self.engine = self.pipeline.engine
        else:
            self.engine = wrap(self.model, blocks=blocks, materialize=materialize, config=runtime)
        self.scheduler = warmup_cosine(self.engine.optimizer, warmup_steps=min(o.warmup, run.steps),
                                       decay_steps=max(run.steps, 1), min_ratio=o.min_lr_ratio)
        origin = "--lr" if o.lr is not None else "LoRA's default" if self.lora else "the model's default"
        log.info("AdamW: peak lr %g (%s), %d warm-up steps, cosine to %g x peak", config.lr, origin,
                 min(o.warmup, run.steps), o.min_lr_ratio)
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
        state = run_state(self.config, engine=self.engine, scheduler=self.scheduler, sampler=self.sampler,
                          groups=self.groups, pipeline=self.pipeline)
        return state, run_record(self.config, step=self.step, lineage=self.lineage, model=self.engine.model,
                                 lora=self.lora)

    def release_checkpoint_dir(self) -> None:
        """Give up the --checkpoint-dir lock (rank 0; ``close`` does it)."""
        if self.checkpoint_lock is not None:
            self.checkpoint_lock.release()

    # ---- one step

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of inputs ``x`` against shifted targets ``y`` (B, T) through the engine."""
        if self.hf:
            tp_group = self.groups.tp_group if self.groups is not None else None
            return chunked_causal_lm_loss(self.engine.call, self.model, x, y, self.loss_chunk, tp_group)
        return self.engine(x, y)

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """This DP rank's slice of a global batch."""
        if self.uneven is not None:
            return self.uneven.local(t)
        if self.dp_size > 1:
            per = t.shape[0] // self.dp_size
            return t[self.dp_rank * per:(self.dp_rank + 1) * per]
        return t

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """This DP rank's slice of a global batch, on the device."""
        return self._local(t).to(self.engine.device, non_blocking=True)

    def target_weights(self, targets: list[torch.Tensor]) -> list[float]:
        """What the mean losses of this replica's slices of the micro-batches ``targets`` ((B, T)
        each) are multiplied by, so that their mean over the micro-batches, averaged over the DP
        replicas, is the mean loss over every target of the global batches (``IGNORE_INDEX`` targets
        do not count): this slice's count of targets times m * dp / the global count. With every
        target counted: ``loss_weight``; with none: 0 (no gradient)."""
        total = sum(int((y != IGNORE_INDEX).sum()) for y in targets)
        if total == sum(y.numel() for y in targets):
            return [self.loss_weight] * len(targets)
        scale = len(targets) * self.dp_size
        return [int((self._local(y) != IGNORE_INDEX).sum()) * scale / max(total, 1) for y in targets]

    @property
    def loss_weight(self) -> float:
        """What this replica's mean loss is multiplied by: 1, or with --dp-split its share of the
        batch times the DP size (``UnevenBatch.weight``), so the DP average is the batch's mean."""
        return 1.0 if self.uneven is None else self.uneven.weight

    def _dp_mean(self, value: float) -> float:
        """The global batch's mean of ``value``, this replica's mean loss: the DP average of the
        weighted means (``loss_weight``)."""
        if self.dp_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value * self.loss_weight], dtype=torch.float64)
        if dist.get_backend(self.groups.dp_group) == "nccl":
            t = t.to(self.engine.device)
        dist.all_reduce(t, group=self.groups.dp_group)
        return float(t.item()) / self.dp_size

    def train_step(self) -> float:
        """One optimizer step (``accumulation`` micro-batches); returns the mean micro-batch loss."""
        if self.pipeline is not None:  # the micro-batches go through the stages in one schedule step
            x, y = self.sampler.next_batch()
            loss = self.pipeline.step(self._to_device(x), self._to_device(y))
            self.scheduler.step()
            self.step += 1
            return self._dp_mean(loss)
        acc = self.config.runtime.accumulation_steps
        batches = [self.sampler.next_batch() for _ in range(acc)]  # (B, T) int64 each
        # NOTE: through engine.accumulate, which runs the micro-batches one after the other or, with
        # --schedule relay, layer-major; each back-propagates loss / acc. Uneven data parallelism
        # (--dp-split) and targets left out of the loss weight each micro-batch (target_weights).
        weights = self.target_weights([y for _, y in batches])

        def micro_batch_loss(item):
            (x, y), weight = item
            loss = self.loss(self._to_device(x), self._to_device(y))
            return loss if weight == 1.0 else loss * weight

        losses = self.engine.accumulate(list(zip(batches, weights)), micro_batch_loss)
        total = sum(float(v) for v in losses) / self.loss_weight
        self.engine.step()
        self.scheduler.step()
        self.engine.zero_grad()
        self.step += 1
        return self._dp_mean(total / acc)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches (the same value on every rank), in eval mode
        (no dropout) through the window without gradients."""
        if self.pipeline is not None:
            losses = [self.pipeline.evaluate(self._to_device(x), self._to_device(y)) for x, y in self.val]
            return self._dp_mean(sum(losses) / len(losses))
        self.engine.eval()
        try:
            weights = self.target_weights([y for _, y in self.val])
            losses = [float(self.loss(self._to_device(x), self._to_device(y))) * (w / self.loss_weight)
                      for (x, y), w in zip(self.val, weights)]
        finally:
            self.engine.train()
        return self._dp_mean(sum(losses) / len(losses))

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
                m = IntervalMetrics(
                    step=self.step, loss=sum(interval_losses) / len(interval_losses),
                    loss_steps=len(interval_losses),
                    ms_per_step=1e3 * elapsed / steps_in_interval,
                    tokens_per_s=tokens_per_step * steps_in_interval / elapsed,
                    h2d_gbps=s.gbps.get("h2d"), d2h_gbps=s.gbps.get("d2h"),
                    device_peak_bytes=device_peak_bytes(self.engine),
                    host_bytes=self.engine.memory_report().host_store_bytes, overlap=s.overlap_fraction,
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
            stop = self._stop_agreed()
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
                self._barrier()
                res.time.checkpoint_s += time.perf_counter() - t0
            if self.step % run.log_every == 0 or last:
                t_interval = time.perf_counter()  # validation and checkpoints are not step time
                if drain:  # their spans go; a host update still running would lose its own
                    tracer.clear()
            if stop:
                res.stopped_by = self.stop_requested or "a signal on another rank"
                return

    def _stop_agreed(self) -> bool:
        """Whether to stop now: ``stop_requested`` on this rank or, with several processes, on any
        (all ranks stop after the same step, or a collective of the next one would hang)."""
        if self.groups is None:
            return self.stop_requested is not None
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.stop_requested is not None else 0.0])
        if dist.get_backend() == "nccl":
            flag = flag.to(self.engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _barrier(self) -> None:
        if self.groups is not None:
            import torch.distributed as dist

            dist.barrier()

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
