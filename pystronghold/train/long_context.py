"""``--head-tail auto`` and ``--offload-activations auto`` in ``train``: the planner turns them on
only when the run would not fit the device without them.

Where the device budget is known (``--device-budget-mb``, or a CUDA device's free memory less
``device_reserve_bytes``), ``planner.sequence.choose_sequence_settings`` picks the fewest of the two
that make the run fit beside what the user fixed (the chunked loss and the MLP tiles as they are in
effect), among as few the fastest predicted step; one line says what it chose and why. Without a
budget (the CPU backend without ``--device-budget-mb``), a pipeline stage, or a shape the planner
cannot read, "auto" stays for the runtime's own rules (``runtime.optimizer.head_tail.head_tail_on_host``,
``runtime.config.offload_in_effect``).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

from pystronghold.planner.cost import Workload
from pystronghold.planner.hardware import Hardware, format_bytes
from pystronghold.planner.sequence import choose_sequence_settings, settings_words
from pystronghold.runtime.memory.placement import available_host_bytes
from pystronghold.train.autowindow import device_budget, run_workload
from pystronghold.train.context import this_machine

__all__ = ["AUTO_SETTINGS", "choose_long_context_settings"]

log = logging.getLogger(__name__)

AUTO_SETTINGS = {"head_tail_on_host": "head_tail_host", "offload_block_inputs": "offload_inputs"}
"""RuntimeConfig fields that take "auto" in ``train``, and their ``planner.sequence.SETTINGS`` names."""
FLAG_WORDS = {"head_tail_on_host": "--head-tail host", "offload_block_inputs": "--offload-activations on"}


def _hardware(run, budget: int) -> Hardware:
    """This machine as the planner sees it (``train.context.this_machine``), its device holding
    ``budget`` bytes, its host the run's --host-memory (else what is available) and --nvme's free disk."""
    rt = run.runtime
    machine = this_machine()
    host = rt.host_memory_bytes or available_host_bytes()
    nvme = shutil.disk_usage(rt.nvme_dir).free if rt.nvme_dir else 0
    return dataclasses.replace(machine, gpu=dataclasses.replace(machine.gpu, memory_bytes=budget),
                               host_memory_bytes=int(host), nvme_bytes=nvme)


def choose_long_context_settings(run) -> dict:
    """RuntimeConfig fields (of ``AUTO_SETTINGS``) that ``run`` (a ``train.run.Run`` being
    resolved) leaves "auto", decided by the planner: True when the run needs them to fit the device
    budget, else False. Empty when the runtime's own rules decide (see the module doc)."""
    rt = run.runtime
    free_fields = [name for name in AUTO_SETTINGS if getattr(rt, name) == "auto"]
    offload_applies = rt.checkpointing and rt.schedule_mode != "relay"
    decided = {}
    if "offload_block_inputs" in free_fields and not offload_applies:
        decided["offload_block_inputs"] = False  # no recompute, or the relay stages its own inputs
        free_fields.remove("offload_block_inputs")
    if not free_fields or run.config.parallel.pp > 1:
        return decided
    budget = device_budget(run)
    shape = run.hf_shape if run.hf else run.model  # the planner's shape; None when it cannot be read
    if budget is None or shape is None:
        return decided
    work = run_workload(run, decided)  # the free settings' values are choose_sequence_settings'
    hw = _hardware(run, budget[0])
    chosen = choose_sequence_settings(shape, work, hw, run.seq,
                                      free=tuple(AUTO_SETTINGS[name] for name in free_fields))
    budget_words = f"a device budget of {format_bytes(budget[0])}"
    if not chosen.fits:
        log.warning("long context: the planner finds no placement of %d tokens a sample in %s, not even "
                    "with %s; the runtime's own rules place them", run.seq, budget_words,
                    " and ".join(FLAG_WORDS[name] for name in free_fields))
        return decided
    values = {"head_tail_on_host": chosen.head_tail_on_host, "offload_block_inputs": chosen.offload_block_inputs}
    decided.update({name: values[name] for name in free_fields})
    words = settings_words(Workload(head_tail_on_host=decided.get("head_tail_on_host", False),
                                    offload_block_inputs=decided.get("offload_block_inputs", False) is True))
    log.info("long context: %d tokens a sample fit %s %s", run.seq, budget_words,
             f"with {words} (the planner's fewest)" if words else "with the head/tail and block inputs on the device")
    return decided
