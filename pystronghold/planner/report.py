"""A plan as a JSON-ready dict and as the text tables ``pystronghold plan`` prints."""

from __future__ import annotations

from pystronghold.planner.hardware import format_bytes
from pystronghold.planner.plan import Plan
from pystronghold.planner.sequence import loss_chunk_for, settings_words
from pystronghold.planner.trainable import lora_targets

__all__ = ["plan_to_dict", "finetune_to_dict", "sequence_to_dict", "format_sequence", "split_to_dict", "format_plan", "format_finetune", "format_split",
           "format_table", "format_seconds"]


def plan_to_dict(plan: Plan) -> dict:
    """Every figure of ``plan`` in base units (bytes, seconds, parameters), JSON-serialisable."""
    cfg, work, hw, c, dev, host = plan.config, plan.work, plan.hardware, plan.costs, plan.device, plan.host
    step = plan.step
    return {
        "fits": plan.fits,
        "model": {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
                  "seq": work.seq or cfg.seq_len, "vocab_size": cfg.vocab_size,
                  "params": plan.params, "block_params_per_rank": c.block_params,
                  "tp_size": cfg.tp_size, "dp_size": work.dp_size},
        "workload": {"batch": work.batch, "precision": work.precision,
                     "checkpointing": work.checkpointing, "overlap": work.overlap,
                     "compute_efficiency": work.compute_efficiency},
        "hardware": {"gpu": hw.gpu.name, "gpu_memory_bytes": hw.gpu.memory_bytes,
                     "gpu_flops": hw.gpu.flops(work.precision),
                     "h2d_bytes_per_s": hw.gpu.h2d_bytes_per_s, "d2h_bytes_per_s": hw.gpu.d2h_bytes_per_s,
                     "host_memory_bytes": hw.host_memory_bytes,
                     "cpu_adam_params_per_s": hw.cpu_adam_params_per_s,
                     "nvme_bytes": hw.nvme_bytes, "nvme_bytes_per_s": hw.nvme_bytes_per_s},
        "window": {"chosen": plan.window if plan.fits or plan.window_asked else None, "asked": plan.window_asked, "max_fitting": plan.max_window,
                   "stronghold_formula": plan.stronghold_window},
        "split": split_to_dict(plan),
        "per_block": {"slot_bytes": c.slot_bytes, "input_bytes": c.block_input_bytes,
                      "activation_bytes": c.block_activation_bytes, "fwd_s": c.fwd_s,
                      "bwd_s": c.bwd_s, "load_s": c.load_s, "grad_s": c.grad_s,
                      "allreduce_s": c.allreduce_s, "adam_s": c.adam_s, "recompute_s": c.recompute_s,
                      "resident_bytes": c.resident_block_bytes, "device_adam_s": c.device_adam_s},
        "device": {"window_bytes": dev.window_bytes, "head_tail_bytes": dev.head_tail_bytes,
                   "activation_bytes": dev.activation_bytes, "reserve_bytes": dev.reserve_bytes,
                   "resident_bytes": dev.resident_bytes, "step_grad_bytes": dev.step_grad_bytes,
                   "backward_bytes": dev.backward_bytes, "step_bytes": dev.step_bytes,
                   "peak_bytes": dev.peak_bytes, "capacity_bytes": dev.capacity_bytes, "fits": dev.fits},
        "host": {"tier": host.tier, "host_bytes": host.host_bytes,
                 "host_capacity_bytes": host.host_capacity_bytes, "disk_bytes": host.disk_bytes,
                 "disk_capacity_bytes": host.disk_capacity_bytes,
                 "disk_states": list(host.disk_states), "disk_reason": host.disk_reason, "fits": host.fits},
        "step": None if step is None else {
            "total_s": step.total_s, "compute_s": step.compute_s,
            "exposed_transfer_s": step.exposed_transfer_s,
            "exposed_optimizer_s": step.exposed_optimizer_s, "tokens_per_s": plan.tokens_per_s},
        "finetune": finetune_to_dict(plan),
        "sequence": sequence_to_dict(plan),
        "largest": [{"hidden": r.hidden, "heads": r.heads, "layers": r.layers, "params": r.params,
                     "bound": r.bound, "window": r.window, "step_s": r.step_s} for r in plan.largest],
    }


def _settings_dict(plan: Plan) -> dict:
    work, seq = plan.work, plan.work.seq or plan.config.seq_len
    chunk = work.loss_chunk_tokens
    return {"loss_chunk_tokens": loss_chunk_for(plan.config, work, seq) if chunk is None else chunk,
            "mlp_tile_tokens": work.mlp_tile_tokens,
            "head_tail_on_host": work.head_tail_on_host, "offload_block_inputs": work.offload_block_inputs}


def sequence_to_dict(plan: Plan) -> dict:
    """The long-context settings of the plan, the offloaded inputs' bytes, and the longest context
    that fits (tokens, its settings, step seconds, tokens/s; None when not searched)."""
    longest = plan.longest
    return {"settings": _settings_dict(plan), "input_host_bytes": plan.host.input_host_bytes,
            "input_disk_bytes": plan.host.input_disk_bytes,
            "longest": None if longest is None else {
                "seq": longest.seq, "settings": None if longest.plan is None else _settings_dict(longest.plan),
                "step_s": longest.plan.step.total_s if longest.plan and longest.plan.step else None,
                "tokens_per_s": longest.plan.tokens_per_s if longest.plan else 0.0,
                "peak_device_bytes": longest.plan.device.peak_bytes if longest.plan else None}}


def format_sequence(plan: Plan) -> list[str]:
    """The long-context lines: the settings this plan needs (when any), the longest context."""
    work, host, out = plan.work, plan.host, []
    needed = settings_words(work)
    if needed:
        where = (f"; inputs: {format_bytes(host.input_host_bytes)} host, {format_bytes(host.input_disk_bytes)} NVMe"
                 if work.offload_block_inputs else "")
        out.append(f"sequence  {work.seq or plan.config.seq_len} tokens need: {needed}{where}")
    longest = plan.longest
    if longest is not None:
        if longest.plan is None:
            out.append("longest context: none fits (not even 1024 tokens)")
        else:
            lp = longest.plan
            step = f"step {format_seconds(lp.step.total_s)}, {lp.tokens_per_s:,.0f} tokens/s" if lp.step else ""
            out.append(f"longest context: {longest.seq:,} tokens at batch {lp.work.batch} "
                       f"({settings_words(lp.work) or 'none needed'}; device peak {format_bytes(lp.device.peak_bytes)}; {step})")
    return out


def finetune_to_dict(plan: Plan) -> dict:
    """What trains and where the frozen parameters live: parameters, and bytes (host and disk: of
    the machine's ranks together, as ``host``; device: per rank), padding aside."""
    ft, c, host = plan.work.finetune, plan.costs, plan.host
    s = plan.work.dtype_bytes * plan.config.tp_size * plan.work.dp_size
    streamed = plan.streamed_blocks
    on_disk = host.frozen_disk_blocks
    return {"lora_rank": ft.lora_rank, "freeze": ft.freeze,
            "lora_targets": None if ft.lora_rank is None else list(lora_targets(plan.config, ft)),
            "trainable_params": plan.trainable_params, "frozen_params": plan.frozen_params,
            "frozen_host_bytes": (streamed - on_disk) * c.block_frozen_params * s,
            "frozen_disk_bytes": on_disk * c.block_frozen_params * s,
            "frozen_device_bytes": (plan.resident_blocks * c.block_frozen_params + plan.frozen_params
                                    - plan.config.layers * c.block_frozen_params) * plan.work.dtype_bytes}


def split_to_dict(plan: Plan) -> dict:
    """Where the blocks go: resident with a device optimizer, streamed, recomputed; bytes of each."""
    c, host = plan.costs, plan.host
    return {"resident_blocks": plan.resident_blocks, "resident_asked": plan.resident_asked,
            "resident_recompute": plan.resident_recompute, "resident_bytes": plan.device.resident_bytes,
            "streamed_blocks": plan.streamed_blocks, "window_bytes": plan.device.window_bytes,
            "streamed_host_bytes": host.host_bytes - plan.work.host_reserve_bytes,
            "recomputed_blocks": plan.recomputed_blocks,
            "recomputed_saved_bytes": plan.recomputed_blocks * (c.block_activation_bytes - c.block_input_bytes)}


def format_split(plan: Plan) -> list[str]:
    """Three lines: the blocks resident with a device optimizer, streamed, recomputed, with bytes."""
    d, n, k = split_to_dict(plan), plan.config.layers, plan.resident_blocks
    how = "as asked" if plan.resident_asked is not None else "chosen"
    host = "host store" if plan.host.tier == "host" else "host store incl. NVMe staging"
    keep = "recomputed" if plan.resident_recompute else "activations kept"
    streamed = (f"streamed  {d['streamed_blocks']} blocks through W={plan.window} slots: "
                f"{format_bytes(d['window_bytes'])} on the device, {format_bytes(d['streamed_host_bytes'])} {host}, "
                "CPU Adam" if d["streamed_blocks"] else "streamed  0 blocks: no window, no host store")
    state = ("params, grads, fp32 masters and moments" if not plan.costs.block_frozen_params else
             "frozen params; trainable ones with grads, fp32 masters and moments")
    return [f"resident  {k} of {n} blocks ({how}) with device AdamW: {format_bytes(d['resident_bytes'])} on the "
            f"device ({state}; {keep})",
            streamed,
            f"recompute {d['recomputed_blocks']} blocks (saves {format_bytes(d['recomputed_saved_bytes'])} of "
            "activations)"]


def _what_trains(plan: Plan) -> str:
    ft = plan.work.finetune
    if ft.lora_rank is not None:
        return f"LoRA r={ft.lora_rank} on {','.join(lora_targets(plan.config, ft))}"
    return "full fine-tune" if ft.full else f"--freeze {ft.freeze!r}"


def format_finetune(plan: Plan) -> list[str]:
    """Two lines: what trains, and where the frozen parameters live (none in a full fine-tune)."""
    if plan.work.finetune.full:
        return []
    d, c, host = finetune_to_dict(plan), plan.costs, plan.host
    s = plan.work.dtype_bytes
    disk = (f", NVMe {format_bytes(d['frozen_disk_bytes'])} (the last {host.frozen_disk_blocks} streamed blocks, "
            "read at each load)" if host.frozen_disk_blocks else "")
    return [f"trains    {_what_trains(plan)}: {_params(d['trainable_params'])} trainable params "
            f"({100 * d['trainable_params'] / max(plan.params, 1):.2g}% of the model), "
            f"{_params(d['frozen_params'])} frozen",
            f"frozen    {s} B/param ({plan.work.precision}), no optimizer state, no gradient: "
            f"{format_bytes(d['frozen_host_bytes'])} of the host store{disk}, device "
            f"{format_bytes(d['frozen_device_bytes'])} (head, tail"
            f"{', resident blocks' if plan.resident_blocks and c.block_frozen_params else ''})"]


def format_table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """Columns two spaces apart; ``align`` has one "l" or "r" per column (default: the first
    left-aligned, the others right-aligned)."""
    align = align or "l" + "r" * (len(header) - 1)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = []
    for row in [header, *rows]:
        cells = [str(x).ljust(w) if a == "l" else str(x).rjust(w) for x, w, a in zip(row, widths, align)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _params(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.1f} M"


def format_seconds(t: float) -> str:
    """``t`` seconds in s, ms or us (a small model's 40 us block is not 0.0 ms)."""
    if 0 < t < 1e-3:
        return f"{t * 1e6:,.1f} us"
    return f"{t * 1e3:,.1f} ms" if t < 1 else f"{t:,.2f} s"


def _share(part: float, total: float) -> str:
    """``part`` of ``total`` in whole percent; NOTE: a share that rounds to 0% or 100% without
    being it reads "<1%" or ">99%" (an exposed transfer of 0.3% is not none)."""
    share = 100 * part / total
    if 0 < share < 0.5:
        return "<1%"
    if 99.5 <= share < 100:
        return ">99%"
    return f"{share:.0f}%"


def format_plan(plan: Plan) -> str:
    """The human-readable report: model, window, memory, step time, largest models."""
    cfg, work, hw, c, dev, host = plan.config, plan.work, plan.hardware, plan.costs, plan.device, plan.host
    seq = work.seq or cfg.seq_len
    out = [f"model     {cfg.layers} layers x {cfg.hidden} hidden, {cfg.heads} heads, "
           f"{_params(plan.params)} params ({_params(c.block_params)} per block), seq {seq}, "
           f"batch {work.batch}, {work.precision}, tp {cfg.tp_size} dp {work.dp_size}",
           *format_finetune(plan),
           f"hardware  {hw.gpu.name}: {format_bytes(hw.gpu.memory_bytes)}, "
           f"{hw.gpu.flops(work.precision) / 1e12:,.1f} TFLOP/s x {work.compute_efficiency:.2f}, "
           f"H2D {hw.gpu.h2d_bytes_per_s / 1e9:.1f} GB/s; host {format_bytes(hw.host_memory_bytes)}, "
           f"CPU Adam {hw.cpu_adam_params_per_s / 1e9:.2f} G params/s"
           + (f", NVMe {format_bytes(hw.nvme_bytes)} at {hw.nvme_bytes_per_s / 1e9:.1f} GB/s" if hw.nvme_bytes else ""),
           ""]
    store_host = host.host_bytes - work.host_reserve_bytes - host.input_host_bytes - host.head_tail_host_bytes
    host_bpp = store_host / max(plan.streamed_blocks * c.block_params
                                                                 * cfg.tp_size * work.dp_size, 1)
    if plan.window_asked is not None:
        how = "as asked" if plan.window_asked == plan.window else \
            f"asked {plan.window_asked}, clamped to the {cfg.layers} blocks"
    elif plan.fits:
        how = "smallest within 1% of the best step time"
    else:
        how = "none chosen: the model does not fit"
    if plan.fits and plan.streamed_blocks == 0:
        out.append(f"window W  none (every block resident: nothing streams; STRONGHOLD formula: "
                   f"{plan.stronghold_window})")
    else:
        out.append(f"window W  {plan.window if plan.fits or plan.window_asked else '-'} ({how}; up to "
                   f"{plan.max_window} fit beside the resident blocks; STRONGHOLD formula: {plan.stronghold_window})")
    out += format_split(plan)
    update = "host update (NVMe read + write)" if host.tier == "nvme" else "CPU Adam"
    t = format_seconds
    out.append(f"per block fwd {t(c.fwd_s)}, bwd {t(c.bwd_s)}, load {t(c.load_s)}, grad out {t(c.grad_s)}, "
               f"{update} {t(c.adam_s)}, device AdamW {t(c.device_adam_s)}")
    out += ["", format_table(["memory", "bytes", "of"], [
        ["device: resident blocks", format_bytes(dev.resident_bytes),
         f"{plan.resident_blocks} x {format_bytes(c.resident_block_bytes - c.resident_fp32_grad_bytes)}"],
        ["device: window", format_bytes(dev.window_bytes),
         f"{plan.window} x {format_bytes(c.slot_bytes)}" if plan.window else "-"],
        ["device: head + tail", format_bytes(dev.head_tail_bytes),
         "params, grads, AdamW" if plan.work.finetune.full else "trainable: params, grads, AdamW; frozen: params"],
        ["device: activations", format_bytes(dev.activation_bytes),
         f"{plan.recomputed_blocks} blocks checkpointed, {cfg.layers - plan.recomputed_blocks} kept "
         "(forward/backward only)"],
        ["device: fp32 grads", format_bytes(dev.step_grad_bytes),
         "optimizer step only: head/tail's and one resident block's" if dev.step_grad_bytes else "-"],
        ["device: reserve", format_bytes(dev.reserve_bytes), ""],
        ["device: peak", format_bytes(dev.peak_bytes),
         f"of {format_bytes(dev.capacity_bytes)}: the larger of forward/backward {format_bytes(dev.backward_bytes)} "
         f"and step {format_bytes(dev.step_bytes)}{'' if dev.fits else '  TOO BIG'}"],
        ["host", format_bytes(host.host_bytes),
         f"{host_bpp:.1f} B/param{' incl. staging' if host.tier == 'nvme' else ''} + "
         + (f"{format_bytes(host.input_host_bytes)} block inputs + " if host.input_host_bytes else "")
         + (f"{format_bytes(host.head_tail_host_bytes)} head/tail + " if host.head_tail_host_bytes else "") + 
         f"{format_bytes(work.host_reserve_bytes)} reserve, of {format_bytes(host.host_capacity_bytes)}"
         f"{'' if host.host_bytes <= host.host_capacity_bytes else '  TOO BIG'}"],
        ["disk (NVMe)", format_bytes(host.disk_bytes),
         (", ".join(host.disk_states + (("offloaded block inputs",) if host.input_disk_bytes else ()))
          + f" of {format_bytes(host.disk_capacity_bytes)}; {format_bytes(host.disk_step_bytes)} read+written "
          "per step") if host.disk_states or host.input_disk_bytes else "-"],
    ], align="lrl")]
    if host.disk_reason:
        out.append(f"NVMe tier {host.disk_reason}")
    if plan.step is not None:
        st = plan.step
        rows = [["compute", t(st.compute_s), _share(st.compute_s, st.total_s)],
                ["exposed transfer", t(st.exposed_transfer_s), _share(st.exposed_transfer_s, st.total_s)],
                ["exposed optimizer", t(st.exposed_optimizer_s), _share(st.exposed_optimizer_s, st.total_s)],
                ["step", t(st.total_s), f"{plan.tokens_per_s:,.0f} tokens/s"]]
        out += ["", format_table(["step time", "seconds", "share"], rows, align="lrl")]
    else:
        host_short = "host memory" + ("" if hw.nvme_bytes else " (--nvme GB puts optimizer states on NVMe)")
        out += ["", "DOES NOT FIT: " + ", ".join(
            what for what, ok in [("device memory (even W = 1)", plan.max_window >= 1 and dev.fits),
                                  (host_short, host.host_bytes <= host.host_capacity_bytes),
                                  ("disk (more than the --nvme space)", host.disk_bytes <= host.disk_capacity_bytes)]
            if not ok)]
    seq_lines = format_sequence(plan)
    if seq_lines:
        out += ["", *seq_lines]
    if plan.largest:
        rows = [[str(r.hidden), str(r.heads), str(r.layers), _params(r.params), r.bound, str(r.window or "none"),
                 format_seconds(r.step_s)] if r.layers else [str(r.hidden), str(r.heads), "0", "-", r.bound, "-", "-"]
                for r in plan.largest]
        none = "; W none: every block resident" if any(r.layers and not r.window for r in plan.largest) else ""
        how = "" if work.finetune.full else f", {_what_trains(plan)}"
        out += ["", f"largest trainable model (same seq, batch, precision{how}; W = 1 must fit beside the "
                f"most resident blocks the device holds{none}):",
                format_table(["hidden", "heads", "layers", "params", "bound by", "W", "step"], rows)]
    return "\n".join(out)
