"""The settings a resume depends on: written into every checkpoint's meta.json, compared
on load, one `error:` line naming the setting when they differ.

A setting belongs here when it changes the shape of saved state (the model, the layout, the
controller's unit list and window, the monitors) or its meaning (the data order and
position, the LR schedule megatron's scheduler checks, the precision of the master weights).
Everything else (thresholds, budgets, intervals, logging) is a setting of the resumed run and
may change freely: settings are not state.
"""

from __future__ import annotations

import dataclasses
import functools
import json

from megatron_gnmr.config import ModelConfig, RunConfig, flag_name
from megatron_gnmr.controller.config import UNITS_FORMER_DEFAULT
from megatron_gnmr.model_families.llama import ATTENTION_LINEARS
from megatron_gnmr.platform.megatron_compat import MLP_LINEARS
from megatron_gnmr.errors import UserError

CONTRACT = {
    "model": None,  # every field
    "mla": None,  # the deepseek-mla family's widths
    # The layout of saved state; sequence parallelism, overlap and recompute change none.
    "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "use_distributed_optimizer"),
    "training": ("bf16", "seed", "global_batch_size", "train_iters", "train_samples", "lr",
                 "min_lr", "lr_decay_style", "lr_decay_iters", "lr_decay_samples",
                 "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction", "lr_warmup_init",
                 "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
                 "weight_decay", "start_weight_decay", "end_weight_decay",
                 "weight_decay_incr_style"),
    "checkpoint": ("finetune",),
    "data": ("split",),
    "precision": ("precision_recipe",),
}
WHEN_ON = {  # checked only when the component is on in both runs (its on-switch always is)
    "gnmr": ("enabled", ("units", "delta", "signals", "qerr_baseline", "selection_seed",
                         "budget_rate", "budget_in")),
    "monitor": ("monitors", ("monitor_detector", "monitor_interval", "monitor_delta")),
    "lora": ("enabled", ("target_modules", "dim", "alpha")),
}
# Defaults whose spelling changed while what they select did not: {flag: former values}.
FORMER_DEFAULTS = {"--gnmr-units": (UNITS_FORMER_DEFAULT,),
                   # LLaMA's four linears, spelled out before the families' defaults
                   "--lora-target-modules": ([*ATTENTION_LINEARS, *MLP_LINEARS],)}
LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
          "expert_model_parallel_size")
# What a torch_dist checkpoint may be resumed with changed: the layout (megatron-core
# reshards the model and the optimizer) and the run's length and LR schedule (the scheduler's
# own check decides, with Megatron-LM's --override-opt-param-scheduler /
# --use-checkpoint-opt-param-scheduler).
RESHARDABLE = frozenset({"launch processes", *(flag_name("parallel", n) for n in (
    *LAYOUT, "use_distributed_optimizer"))} | {flag_name("training", n) for n in (
        "train_iters", "train_samples", "lr", "min_lr", "lr_decay_style", "lr_decay_iters",
        "lr_decay_samples", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction",
        "lr_warmup_init", "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
        "weight_decay", "start_weight_decay", "end_weight_decay", "weight_decay_incr_style")})


def resume_settings(config, dataset: str, vocab_size: int, world_size: int) -> dict:
    """{flag: value} of everything a resume of this run must keep (JSON values)."""
    settings = {"launch processes": world_size, "dataset": dataset, "vocab size": vocab_size}
    for section, names in CONTRACT.items():
        if section == "mla" and config.model.model_family != "deepseek-mla":
            continue  # another family's widths build nothing here (their defaults may move)
        values = getattr(config, section)
        for name in names or [f.name for f in dataclasses.fields(values)]:
            settings[flag_name(section, name)] = getattr(values, name)
    for section, (switch, names) in WHEN_ON.items():
        values = getattr(config, section)
        settings[flag_name(section, switch)] = getattr(values, switch)
        if getattr(values, switch):
            settings.update({flag_name(section, name): getattr(values, name) for name in names})
    return json.loads(json.dumps(settings))  # as meta.json will give it back


def _padded_vocab(settings: dict) -> int:
    multiple = settings["--make-vocab-size-divisible-by"] * \
        settings["--tensor-model-parallel-size"]
    return -(-settings["vocab size"] // multiple) * multiple


# Model settings whose None means "derived from the others", with the derivation: a
# checkpoint that spells a derived value out (import-hf writes every value) and a run that
# leaves it to the default built the same model.
DERIVED = {
    "--kv-channels": lambda s: s["--hidden-size"] // s["--num-attention-heads"],
    "--num-query-groups": lambda s: s["--num-attention-heads"],
    "--max-position-embeddings": lambda s: s["--seq-length"],
    "--padded-vocab-size": _padded_vocab,
}


def effective(settings: dict) -> dict:
    """`settings` with each derived model value that is None replaced by what it derives
    to (left as is where what it derives from is not recorded)."""
    out = dict(settings)
    for name, derive in DERIVED.items():
        if name in out and out[name] is None:
            try:
                out[name] = derive(settings)
            except (KeyError, TypeError, ZeroDivisionError):
                pass
    return out


# Model settings that shape no weight (RoPE has no position table): a fine-tune may choose
# its own sequence length and dropouts.
NOT_IN_THE_WEIGHTS = frozenset(flag_name("model", name) for name in (
    "seq_length", "max_position_embeddings", "attention_dropout", "hidden_dropout"))


def base_settings(settings: dict) -> dict:
    """What a fine-tune's base must share with it (per-rank weights): the model's shape,
    the parallel layout, the process count and the vocabulary."""
    names = {flag_name("model", f.name) for f in dataclasses.fields(ModelConfig)} - \
        NOT_IN_THE_WEIGHTS
    names |= {flag_name("parallel", name) for name in LAYOUT}
    names |= {"launch processes", "vocab size"}
    return {name: value for name, value in settings.items() if name in names}


def check_resume(directory, saved: dict | None, current: dict,
                 reshardable: bool = False) -> None:
    """A UserError naming the first setting that differs between checkpoint and run (with
    `reshardable`, a torch_dist checkpoint: the layout and the schedule may differ)."""
    if not isinstance(saved, dict):
        raise UserError(f"--load {directory}: meta.json records no settings (written by an "
                        "older megatron-gnmr); start a new run")
    saved, current = effective(saved), effective(current)
    for name, value in current.items():
        if reshardable and name in RESHARDABLE:
            continue
        if name not in saved and not recorded_as_default(saved, name, value):
            raise UserError(f"--load {directory}: the checkpoint does not record {name} (written"
                            " by another version of megatron-gnmr); start a new run")
        if saved.get(name) != value and not recorded_as_default(saved, name, value):
            raise UserError(f"--load {directory}: the checkpoint was written with {name} "
                            f"{_show(saved[name])}, this run has {_show(value)}; resume with the "
                            f"checkpoint's {name}, or start a new run (another --save, or "
                            "--overwrite)")


def recorded_as_default(saved: dict, name: str, value) -> bool:
    """Whether a checkpoint that lacks `name`, or records a former spelling of its default,
    ran with `value`: true when `value` is the setting's default (a setting is added with a
    default that keeps what the project did before it existed)."""
    defaults = contract_defaults()
    if name not in defaults or value != defaults[name]:
        return False
    return name not in saved or saved[name] in FORMER_DEFAULTS.get(name, ())


@functools.lru_cache(maxsize=None)
def contract_defaults() -> dict:
    """{flag: default} of every setting the contract can record. A setting is added with a
    default that keeps what the project did before it existed, so a checkpoint written
    before it ran with that default."""
    config = RunConfig()
    return json.loads(json.dumps({
        flag_name(section, spec.name): getattr(getattr(config, section), spec.name)
        for section in (*CONTRACT, *WHEN_ON)
        for spec in dataclasses.fields(getattr(config, section))}))


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) < 80 else text[:77] + "..."
