"""The learning-rate and weight-decay schedule, with Megatron-LM's flags and meaning: what
`megatron/training/training.py:get_optimizer_param_scheduler` builds, built here the same way
around megatron-core's own `OptimizerParamScheduler`.

The schedule counts samples, as Megatron-LM's does (it steps by the global batch each
iteration): iteration-based runs (--train-iters) convert their --lr-*-iters by the global
batch, sample-based ones (--train-samples) give --lr-*-samples directly. A warm-up fraction
is a share of the decay length. The checks are Megatron-LM's (`validate_args`), each a one
line UserError naming the flags.
"""

from __future__ import annotations

from megatron_gnmr.errors import UserError

SAMPLE_FLAGS = ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")
ITERATION_FLAGS = ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_schedule(t) -> None:
    """Megatron-LM's rules between the schedule's flags (TrainingConfig `t`)."""
    by_samples = t.train_samples is not None
    wrong = [name for name in (ITERATION_FLAGS if by_samples else SAMPLE_FLAGS)
             if getattr(t, name)]
    if wrong:
        unit = "--train-samples counts samples" if by_samples else \
            "--train-iters counts iterations"
        raise UserError(f"{', '.join(map(_flag, wrong))}: {unit}; use the "
                        f"{'-samples' if by_samples else '-iters'} forms (Megatron-LM's rule)")
    warmup = t.lr_warmup_samples if by_samples else t.lr_warmup_iters
    if t.lr_warmup_fraction is not None and warmup:
        raise UserError(f"--lr-warmup-fraction and {_flag(_warmup_name(by_samples))} are "
                        "exclusive: give one")
    steps = schedule_steps(t)
    if steps["lr_warmup_steps"] >= steps["lr_decay_steps"]:
        raise UserError(f"the warm-up ({_describe(t, 'warmup')}) must end before the decay "
                        f"does ({_describe(t, 'decay')})")
    if t.lr_decay_style == "WSD" and steps["wsd_decay_steps"] is None:
        raise UserError(f"--lr-decay-style WSD needs "
                        f"{'--lr-wsd-decay-samples' if by_samples else '--lr-wsd-decay-iters'}")
    if t.min_lr > t.lr:
        raise UserError(f"--min-lr {t.min_lr} must not exceed --lr {t.lr}")


def _warmup_name(by_samples: bool) -> str:
    return "lr_warmup_samples" if by_samples else "lr_warmup_iters"


def _describe(t, part: str) -> str:
    by_samples = t.train_samples is not None
    if part == "warmup":
        if t.lr_warmup_fraction is not None:
            return f"--lr-warmup-fraction {t.lr_warmup_fraction}"
        name = _warmup_name(by_samples)
        return f"{_flag(name)} {getattr(t, name)}"
    name = "lr_decay_samples" if by_samples else "lr_decay_iters"
    value = getattr(t, name)
    if value is None:
        return f"--train-samples {t.train_samples}" if by_samples else \
            f"--train-iters {t.train_iters}"
    return f"{_flag(name)} {value}"


def schedule_steps(t) -> dict:
    """The scheduler's lengths in samples, as Megatron-LM computes them."""
    batch = t.global_batch_size
    if t.train_samples is None:
        decay = (t.lr_decay_iters or t.train_iters) * batch
        wd_steps = t.train_iters * batch
        wsd = t.lr_wsd_decay_iters * batch if t.lr_wsd_decay_iters else None
        warmup = t.lr_warmup_iters * batch
    else:
        decay = t.lr_decay_samples or t.train_samples
        wd_steps = t.train_samples
        wsd = t.lr_wsd_decay_samples
        warmup = t.lr_warmup_samples
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wd_incr_steps": wd_steps,
            "wsd_decay_steps": wsd}


def build_scheduler(t, optimizer, override: bool = False, use_checkpoint: bool = False):
    """megatron-core's OptimizerParamScheduler for TrainingConfig `t`; step it with
    `increment=global_batch_size` each iteration. `override` / `use_checkpoint`: Megatron-LM's
    --override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler (which settings win
    when a checkpoint's scheduler is loaded)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = t.weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=t.lr_warmup_init, max_lr=t.lr, min_lr=t.min_lr,
        lr_decay_style=t.lr_decay_style,
        start_wd=decay if t.start_weight_decay is None else t.start_weight_decay,
        end_wd=decay if t.end_weight_decay is None else t.end_weight_decay,
        wd_incr_style=t.weight_decay_incr_style, lr_wsd_decay_style=t.lr_wsd_decay_style,
        use_checkpoint_opt_param_scheduler=use_checkpoint,
        override_opt_param_scheduler=override, **schedule_steps(t))


def upgrade_state(state: dict, step: int, global_batch_size: int) -> dict:
    """A scheduler state saved before the schedule counted samples (it counted iterations:
    num_steps equal to the run's step) in samples, as it is counted now."""
    if step == 0 or state["num_steps"] != step or global_batch_size == 1:
        return state
    upgraded = dict(state)
    for key in ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps"):
        upgraded[key] = state[key] * global_batch_size
    return upgraded
