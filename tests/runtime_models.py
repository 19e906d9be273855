"""Small models and training loops shared by the runtime tests (not a test file)."""

from __future__ import annotations

import copy
import queue as queue_lib
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def tiny_gpt(layers: int = 8) -> GPT:
    """8 blocks, hidden 64, seq 32: the runtime tests' GPT."""
    return GPT(GPTConfig(vocab_size=97, seq_len=32, layers=layers, hidden=64, heads=4))


def gpt_batches(steps: int, batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 97, (batch, 32), generator=g), torch.randint(0, 97, (batch, 32), generator=g))
            for _ in range(steps)]


# ---- a stack of blocks that differ in size and structure


class MLPBlock(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ScaleBlock(nn.Module):
    """Tiny block: elementwise scale and shift, with a (non-parameter) buffer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.shift = nn.Parameter(0.1 * torch.randn(d))
        self.register_buffer("offset", torch.full((d,), 0.01))

    def forward(self, x):
        return torch.tanh(x * self.scale + self.shift) + self.offset


class AttnBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class HetStack(nn.Module):
    """head (Linear) -> heterogeneous blocks -> tail (Linear + MSE loss)."""

    def __init__(self, d: int = 24, d_in: int = 10) -> None:
        super().__init__()
        self.head = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([MLPBlock(d, 40), ScaleBlock(d), AttnBlock(d), MLPBlock(d, 8),
                                     ScaleBlock(d), MLPBlock(d, 96)])
        self.tail = nn.Linear(d, 3)

    def forward(self, x, y=None):
        h = self.head(x)
        for block in self.blocks:
            h = block(h)
        out = self.tail(h)
        return out if y is None else F.mse_loss(out, y)


def het_batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 5, 10, generator=g), torch.randn(4, 5, 3, generator=g)) for _ in range(steps)]


# ---- a slow copy link


class SlowCopies:
    """Test double of the CPU backend's copy engine (``backend.copies``): a slow link.

    Each of ``queues`` gets one worker thread that runs its requests in order: it waits for the
    request's ``after`` handles, then holds the request ``delay_s`` seconds (a sleep: no CPU used,
    so the figure holds on a loaded machine) and moves the bytes with the wrapped engine. Other
    queues pass straight through. Handles stamp ``start_s``/``end_s`` on ``time.monotonic()`` like
    the real ones, so the trace shows the slow copies as they happened. ``served`` counts the
    requests held so far.
    """

    def __init__(self, inner, delay_s: float, queues=(0, 1)) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.served = 0
        self._served_lock = threading.Lock()
        self._work = {q: queue_lib.SimpleQueue() for q in queues}
        self._threads = [threading.Thread(target=self._serve, args=(w,), daemon=True) for w in self._work.values()]
        for t in self._threads:
            t.start()

    def copy(self, dst, src, *, queue=0, after=()):
        if queue not in self._work:
            return self.inner.copy(dst, src, queue=queue, after=after)
        handle = _SlowHandle(dst.numel() * dst.element_size(), queue)
        self._work[queue].put((handle, dst, src, list(after)))
        return handle

    def _serve(self, work) -> None:
        while (item := work.get()) is not None:
            handle, dst, src, after = item
            try:
                for h in after:
                    h.wait()
                handle.start_s = time.monotonic()
                time.sleep(self.delay_s)
                self.inner.copy(dst, src, queue=handle.queue).wait()
            except BaseException as e:  # handed to whoever waits, like the engine's CopyError
                handle.error = e
            handle.end_s = time.monotonic()
            with self._served_lock:  # counted before the handle reads as done
                self.served += 1
            handle.finished.set()

    def close(self, wait: bool = True) -> None:
        for work in self._work.values():
            work.put(None)
        for t in self._threads:
            t.join()
        self.inner.close(wait)


class _SlowHandle:
    """A ``CopyHandle`` look-alike for ``SlowCopies``."""

    def __init__(self, nbytes: int, queue: int) -> None:
        self.nbytes, self.queue = nbytes, queue
        self.start_s = self.end_s = 0.0
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def wait(self, timeout_s=None) -> None:
        if not self.finished.wait(timeout_s):
            raise TimeoutError(f"slow copy of {self.nbytes} bytes not done after {timeout_s} s")
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.finished.is_set()

    @property
    def failed(self) -> bool:
        return self.done() and self.error is not None


# ---- training loops


def _call_model(model, batch):
    """The loss of one ``(x, y)`` batch: ``model(x, y)`` (the models here return their loss)."""
    return model(*batch)


def train_reference(model, batches, *, clip=None, accumulation=1, scheduler=None, optimizer=None,
                    loss_of=_call_model):
    """Plain PyTorch + torch.optim.AdamW. Returns (losses, {name: parameter}).

    ``optimizer``: a torch optimizer over ``model``'s parameters, for a caller that keeps it (its
    param groups, its state dict); default AdamW(**HYPER) over the trainable ones (clipping too:
    a frozen parameter, ``requires_grad=False``, is in neither). ``loss_of(model, batch)``: the
    loss of one item of ``batches``."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, **HYPER) if optimizer is None else optimizer
    sched = scheduler(opt) if scheduler else None
    losses = []
    for k, batch in enumerate(batches):
        loss = loss_of(model, batch)
        loss.backward()
        losses.append(loss.item())
        if (k + 1) % accumulation == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(trainable, clip)
            opt.step()
            opt.zero_grad()
            if sched:
                sched.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_engine(model, batches, *, accumulation=1, scheduler=None, engine_hook=None, bitwise_torch=True,
                 loss_of=_call_model, **options):
    """The same loop through pystronghold.wrap. Returns (losses, {name: fp32 parameter}, engine).

    ``options`` go to ``wrap``; ``blocks`` defaults to ``model.blocks`` (``blocks=None``: wrap finds
    them). ``loss_of(engine, batch)``: the loss of one item of ``batches``."""
    # NOTE: bitwise_torch by default: the reference is CPU torch.optim.AdamW, whose sqrt is MKL's
    # (1 ulp off IEEE on some inputs).
    if "blocks" not in options:
        options["blocks"] = model.blocks
    engine = ph.wrap(model, optimizer=ph.AdamW(**HYPER, bitwise_torch=bitwise_torch),
                     accumulation_steps=accumulation, **options)
    if engine_hook:
        engine_hook(engine)
    sched = scheduler(engine.optimizer) if scheduler else None
    losses = []
    try:
        for k, batch in enumerate(batches):
            loss = loss_of(engine, batch)
            engine.backward(loss)
            losses.append(loss.item())
            if (k + 1) % accumulation == 0:
                engine.step()
                engine.zero_grad()
                if sched:
                    sched.step()
        params = {n: p.clone() for n, p in engine.master_parameters().items()}
    finally:
        engine.close()
    return losses, params, engine


def run_both(make_model, batches, *, clip=None, accumulation=1, scheduler=None, **options):
    """Reference and engine on two copies of the same initial model, run one after the other."""
    model = make_model()
    ref_model = copy.deepcopy(model)
    torch.manual_seed(1234)  # the same dropout masks for both runs
    ref = train_reference(ref_model, batches, clip=clip, accumulation=accumulation, scheduler=scheduler)
    torch.manual_seed(1234)
    got = train_engine(model, batches, clip_grad_norm=clip, accumulation=accumulation,
                       scheduler=scheduler, **options)
    return ref, got


def assert_same_training(ref, got, rtol=1e-6, atol=1e-7):
    (ref_losses, ref_params), (losses, params, _) = ref, got
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=rtol, atol=0)
    assert params.keys() == ref_params.keys()
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name].float(), p.float(), rtol=rtol, atol=atol, msg=name)


def plain_steps(model, opt, batches):
    """One optimizer step per ``(x, y)`` batch in plain PyTorch. Returns the losses."""
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_steps(engine, batches, loss_of=lambda engine, x, y: engine(x, y)):
    """One step per ``(x, y)`` batch through an open engine (left open). Returns the losses."""
    losses = []
    for x, y in batches:
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def one_torch_thread():
    """Generator for an autouse fixture: tiny models run faster on one intra-op thread, and on this
    shared 2-core machine OpenMP workers spinning beside the copy threads cost more than they give."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- PyTorch's mixed-precision recipe, the reference of bf16 and fp16 runs

MIXED_LOSS_RTOL, MIXED_PARAM_ATOL = 2e-3, 1e-4
"""Stated tolerance of a half-precision run against ``train_mixed_reference``: losses to 2e-3
relative and fp32 masters to 1e-4 absolute (one AdamW step at lr=1e-3 moves a weight by ~1e-3, so a
missing, doubled or unscaled update fails). It covers the fused host Adam's last-bit differences
flipping a rounding of the half-precision copy; with the same arithmetic the runs agree bit for bit."""


def train_mixed_reference(model, batches, dtype, *, clip=None, init_scale=2.0**16, loss_of=_call_model):
    """fp32 master copies of the fp32 ``model``'s parameters updated by torch.optim.AdamW, the model
    cast to ``dtype`` computing with them (rewritten from the masters after each step); fp16 adds
    torch.amp.GradScaler (dynamic loss scale, inf/NaN steps skipped). A frozen parameter
    (``requires_grad=False``) has no master: it stays in ``dtype``, untouched.
    Returns (losses, {name: fp32 master, or a frozen parameter's value in fp32}, skipped steps)."""
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters() if p.requires_grad]
    model = model.to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(masters, **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if dtype == torch.float16 else None
    losses, skipped = [], 0
    for batch in batches:  # loss_of(model, batch): the loss of one item of batches
        loss = loss_of(model, batch)
        (scaler.scale(loss) if scaler else loss).backward()
        losses.append(loss.item())
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        if scaler:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        if scaler:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    values = {n: p.detach().float() for n, p in model.named_parameters() if not p.requires_grad}
    values.update(zip([n for n, p in model.named_parameters() if p.requires_grad], [m.detach() for m in masters]))
    return losses, values, skipped


def assert_same_mixed_training(ref, got):
    """``got`` (``train_engine``'s result) matches ``train_mixed_reference``'s ``ref`` to the
    stated tolerance (``MIXED_LOSS_RTOL``, ``MIXED_PARAM_ATOL``)."""
    ref_losses, ref_params = ref[0], ref[1]
    losses, params = got[0], got[1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=MIXED_LOSS_RTOL, atol=0)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=0, atol=MIXED_PARAM_ATOL, msg=name)


def saved_activation_bytes(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the storages autograd saves for ``block(x)``'s backward, its parameters aside (each
    storage once): what the planner's ``block_activation_bytes`` predicts."""
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in params)
