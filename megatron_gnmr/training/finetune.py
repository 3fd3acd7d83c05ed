"""`--finetune --load BASE_RUN`: the base's model weights, and nothing else of it.

The base checkpoint is chosen and hash-checked like any checkpoint (`checkpoints/choice.py`), then
only its model state is read: no optimizer, scheduler, RNG, step or controller state. Its
identity (path and the sha256 of its meta.json, which records every shard's sha256) goes
into the fine-tune's settings, so a fine-tune's checkpoints name their base and a resume
over another base is refused. With LoRA, a fine-tune's checkpoints hold the adapters only;
the base is loaded again from --load on resume.

A base in the torch format (per-rank shards of a fixed layout) must have been written by the
same layout (TP, PP, EP and process count) and model shape as the fine-tune; a torch_dist base
(the default format) only by the same model shape and vocabulary: it is resharded on load.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from megatron_gnmr.checkpoints import per_rank
from megatron_gnmr.checkpoints.choice import choose
from megatron_gnmr.checkpoints.formats import TORCH_DIST, format_of
from megatron_gnmr.checkpoints.torch_dist import run as dist_run
from megatron_gnmr.errors import UserError
from megatron_gnmr.training.consensus import on_every_rank
from megatron_gnmr.training.resume_contract import base_settings, recorded_as_default

ADAPTER = ".adapter."


def is_adapter_key(key: str) -> bool:
    return ADAPTER in f".{key}"


def _description(directory: Path) -> Path:
    """The file that records every other file's sha256: meta.json (torch format) or the
    torch_dist manifest."""
    fmt = format_of(directory) or TORCH_DIST
    return Path(directory) / fmt.description


def base_identity(directory: Path) -> dict:
    """Where the base is and what it is: the sha256 of its description, which covers every
    file's hash."""
    data = _description(directory).read_bytes()
    return {"path": str(Path(directory).resolve()), "sha256": hashlib.sha256(data).hexdigest()}


def check_base_fits(directory: Path, base: dict | None, current: dict,
                    reshardable: bool = False) -> None:
    """The base was written by this run's model shape and layout (per-rank shards; with
    `reshardable`, a torch_dist base: the model shape and vocabulary only)."""
    if not isinstance(base, dict):
        raise UserError(f"--load {directory}: meta.json records no settings (written by an "
                        "older megatron-gnmr)")
    from megatron_gnmr.training.resume_contract import RESHARDABLE, effective

    base = effective(base)
    for name, value in base_settings(effective(current)).items():
        if reshardable and name in RESHARDABLE:
            continue
        if base.get(name) != value and not recorded_as_default(base, name, value):
            raise UserError(f"--finetune --load {directory}: the base was written with {name} "
                            f"{base.get(name)!r}, this run has {value!r}; fine-tune with the "
                            "base's model shape and parallel layout")


def recorded_base(lora_meta: dict, who: str) -> Path:
    """The base a LoRA fine-tune's checkpoint names, refused if it is gone or has changed
    since (its meta.json, which records every shard's sha256, hashes differently)."""
    base = Path(lora_meta["base"]["path"])
    if not _description(base).is_file() or \
            base_identity(base)["sha256"] != lora_meta["base"]["sha256"]:
        raise UserError(f"{who}: its base {base} is gone or has changed since the fine-tune "
                        "(the sha256 of its meta.json differs)")
    return base


def load_base_weights(model_chunks, load: str, current_settings: dict) -> dict:
    """Collective: read the base's model weights into the chunks; returns its identity."""
    choice = choose(load)
    if choice.format.reshards:
        record = choice.format.record(choice.directory)
        check_base_fits(choice.directory, record.get("settings"), current_settings,
                        reshardable=True)
        on_every_rank(lambda: dist_run.load_model_weights(
            model_chunks, choice.directory, f"--finetune --load {choice.directory}",
            not_in_checkpoint=is_adapter_key))
        return base_identity(choice.directory)
    meta = per_rank.read_meta(choice.directory)
    if "lora" in meta:
        raise UserError(f"--finetune --load {choice.directory}: that is a LoRA run's "
                        "checkpoint; merge its adapters into full weights first "
                        "(`megatron-gnmr merge-lora RUN --out MERGED`) and fine-tune from the "
                        "merged run")
    check_base_fits(choice.directory, meta.get("settings"), current_settings)

    def apply() -> None:
        shard = per_rank.load_shard(choice.directory)
        for chunk, state in zip(model_chunks, shard["model"], strict=True):
            load_weights(chunk, state, f"--finetune --load {choice.directory}")
    on_every_rank(apply)
    return base_identity(choice.directory)


def load_weights(chunk: torch.nn.Module, state: dict, source: str) -> None:
    """Weights into a chunk whose adapters (if any) the state lacks; anything else missing
    or unexpected is an error."""
    live = chunk.state_dict()
    unexpected = [k for k in state if k not in live]
    missing = [k for k in live if k not in state and not is_adapter_key(k)
               and not k.endswith("_extra_state")]
    if unexpected or missing:
        first = (unexpected or missing)[0]
        raise UserError(f"{source}: the weights do not fit this model ({len(unexpected)} "
                        f"unexpected, {len(missing)} missing, e.g. {first})")
    with torch.no_grad():
        for key, value in state.items():
            live[key].copy_(value)


def adapter_state(chunk: torch.nn.Module) -> dict:
    """The adapters' weights (megatron's `_extra_state` placeholders left out)."""
    return {k: v for k, v in chunk.state_dict().items()
            if is_adapter_key(k) and not k.endswith("_extra_state")}


def load_adapters(chunk: torch.nn.Module, state: dict, source: str) -> None:
    """A fine-tune's adapters (exactly this model's) into a chunk that holds the base."""
    live = adapter_state(chunk)
    if set(state) != set(live):
        raise UserError(f"{source}: the adapters do not fit this model (a different "
                        "--lora-target-modules or layout)")
    with torch.no_grad():
        for key, value in state.items():
            live[key].copy_(value)
