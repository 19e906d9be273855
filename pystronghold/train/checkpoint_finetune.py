"""What a checkpoint records of a fine-tune (its options: ``settings.finetune.FinetuneOptions``) and
the resume checks against it. Frozen parameters (the LoRA base included) are stored once in the
compute dtype, with no optimizer state; a checkpoint of a ``--model hf:DIR`` run leaves them to DIR
(``checkpoint.py``), and ``checkpoint_record`` is what it keeps to refuse resuming with other
options (``check_checkpoint_record``) or a changed DIR (``check_base``).
"""

from __future__ import annotations

from pystronghold.settings.finetune import LoraSpec

__all__ = ["checkpoint_record", "check_checkpoint_record", "check_base"]


def checkpoint_record(freeze: str | None, lora: LoraSpec | None, base_source: str | None) -> dict:
    """The manifest's entries of a run: ``finetune`` (the adapters, targets as PEFT resolved them,
    and the --freeze pattern) and, when the checkpoint leaves the frozen parameters to the base
    directory ``base_source``, ``base`` (its path and ``weights_fingerprint``)."""
    record = {"finetune": {"lora": lora.record() if lora is not None else None, "freeze": freeze}}
    if base_source is not None:
        from pystronghold.models.hf import weights_fingerprint

        record["base"] = {"source": base_source, "fingerprint": weights_fingerprint(base_source)}
    return record


def _options_text(finetune: dict) -> str:
    lora, freeze = finetune.get("lora"), finetune.get("freeze")
    if lora:
        targets = ",".join(lora["targets"]) if lora.get("targets") else "(PEFT's default)"
        return (f"--lora-rank {lora['rank']} --lora-alpha {lora['alpha']:g} --lora-targets {targets} "
                f"--lora-dropout {lora['dropout']:g}")
    return f"--freeze {freeze!r}" if freeze is not None else "neither --lora-rank nor --freeze"


def check_checkpoint_record(manifest: dict, mine: dict, path) -> None:
    """CheckpointError (one line) unless checkpoint ``path`` (its ``manifest``) was made with the
    fine-tune options of this run (``mine``: its ``checkpoint_record``). A manifest without these
    entries predates them: a full fine-tune. (Whether the base directory still holds the weights it
    was trained from is ``check_base``'s; resume runs it first.)"""
    from pystronghold.train.checkpoint_dir import CheckpointError

    saved = manifest.get("finetune") or {"lora": None, "freeze": None}
    if saved != mine["finetune"]:
        raise CheckpointError(f"checkpoint {path} was trained with {_options_text(saved)}, this run with "
                              f"{_options_text(mine['finetune'])}; resume with the options it was made with")


def _identity(entry):
    """What of a fingerprint entry must match: a hash, or a safetensors file's size and crc32c (a
    bare size: a manifest written before the files were hashed)."""
    from pystronghold.models.hf import FINGERPRINT_IDENTITY

    if isinstance(entry, dict):
        return {k: entry.get(k) for k in FINGERPRINT_IDENTITY}
    return entry


def check_base(manifest: dict, path, use: str) -> None:
    """CheckpointError (one line, saying what ``use`` needs) when checkpoint ``path`` left its
    frozen parameters to a base directory whose config or safetensors files (their bytes, by
    crc32c) have changed since. Files whose size, mtime, ctime and inode are those the manifest
    recorded are not read again (``models.hf.weights_fingerprint``)."""
    base = manifest.get("base")
    if base is None:
        return
    from pystronghold.models.hf import weights_fingerprint
    from pystronghold.train.checkpoint_dir import CheckpointError

    saved, now = base["fingerprint"], weights_fingerprint(base["source"], known=base["fingerprint"])

    def same(name: str) -> bool:
        old, new = saved.get(name), now.get(name)
        if isinstance(old, int) and isinstance(new, dict):  # sizes only were recorded
            return old == new["bytes"]
        return _identity(old) == _identity(new)

    changed = sorted(name for name in {**saved, **now} if not same(name))
    if changed:
        raise CheckpointError(f"checkpoint {path} holds only the trained parameters; the frozen ones come from "
                              f"{base['source']}, which has changed since ({', '.join(changed[:3])}"
                              f"{' and more' if len(changed) > 3 else ''} differ); {use} with the base it was "
                              "trained from")
