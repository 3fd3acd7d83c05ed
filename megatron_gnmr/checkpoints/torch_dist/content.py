"""What a torch_dist checkpoint holds, and how a run goes back into it on any layout.

Sharded (megatron-core reshards them on load): the model (`sharded_state_dict` of every
chunk) and the optimizer, under Megatron-LM's keys `model` and `optimizer`. The distributed
optimizer is written as Megatron-LM writes it: DP-reshardable by default (each rank its own
part: a resume may change DP), fully reshardable with --dist-ckpt-optim-fully-reshardable (a
resume may change TP, PP, DP and EP, at the price of gathering each TP/PP shard's whole state
at every save and load); the form is recorded, and a load reads the form it finds.

Common (written once, by rank 0: into `common.pt` with megatron-core 0.16, as a
`common_state` byte item with 0.19): Megatron-LM's `args`, `checkpoint_version`,
`iteration` and `opt_param_scheduler` (so Megatron-LM reads it as one of its own), and ours
under `megatron_gnmr`: the run state (step = the data position: step x global batch samples),
the controller (its per-unit state is indexed by unit name, the same in every layout), the
alarm book, the layout it was written in and the resume settings.

Per rank, a ShardedObject keyed by global rank: the RNG streams and the attention monitor's
weight snapshots (shards of W_q/W_k). They belong to one layout: on another, the RNG streams
are re-derived from the seed and the step (as a run's start seeds them: the default generator
equal across TP ranks, the model-parallel tracker one per TP rank), the snapshots are taken
again at the next snapshot step (the first check after the resume is skipped), and the run
says so at start.
"""

from __future__ import annotations

import contextlib
from argparse import Namespace

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_gnmr.checkpoints.rng import rng_state
from megatron_gnmr.checkpoints.safe_state import from_plain, to_plain
from megatron_gnmr.checkpoints.torch_dist import te_extra_state
from megatron_gnmr.model import unwrap
from megatron_gnmr.platform.megatron_compat import zero_adam_state

RANK_STATE = "megatron_gnmr/rank_state"
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
# What a layout change needs of the optimizer's form (DP may change in both)
RESHARDS_ONLY_FULLY = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                       "expert_model_parallel_size", "use_distributed_optimizer")


def optimizer_form(checkpoint) -> dict:
    """Megatron-LM's metadata of the distributed optimizer's checkpoint form, as it writes it
    (`_build_sharded_state_dict_metadata`): DP-reshardable by default, fully reshardable on
    request; and keys that do not depend on how megatron chains its optimizers (dense and
    expert ones apart with EP > 1, one optimizer with EP = 1)."""
    if not checkpoint.dist_ckpt_optim_fully_reshardable:
        return {"distrib_optim_sharding_type": DP_RESHARDABLE,
                "chained_optim_avoid_prefix": True}
    return {"distrib_optim_sharding_type": FULLY_RESHARDABLE,
            "distrib_optim_fully_reshardable_mem_efficient":
                checkpoint.distrib_optim_fully_reshardable_mem_efficient,
            "chained_optim_avoid_prefix": True}


# checkpoints written before the form was a choice hold the fully reshardable one
EARLIER_FORM = {"distrib_optim_sharding_type": FULLY_RESHARDABLE,
                "chained_optim_avoid_prefix": True}


def layout(config) -> dict:
    """What the per-rank state depends on."""
    p = config.parallel
    return {"world_size": torch.distributed.get_world_size(),
            "tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "expert_model_parallel_size": p.expert_model_parallel_size,
            "use_distributed_optimizer": p.use_distributed_optimizer}


def megatron_args(config, step: int, padded_vocab_size: int) -> Namespace:
    """The `args` Megatron-LM's loader reads from a checkpoint (its names and meaning)."""
    m, p, t = config.model, config.parallel, config.training
    return Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        group_query_attention=m.num_query_groups is not None,
        num_query_groups=m.num_query_groups or m.num_attention_heads,
        kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
        seq_length=m.seq_length, max_position_embeddings=m.max_position_embeddings or m.seq_length,
        position_embedding_type="rope", rotary_base=m.rotary_base, rotary_percent=1.0,
        normalization="RMSNorm", norm_epsilon=m.norm_epsilon, swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        apply_layernorm_1p=m.apply_layernorm_1p,
        multi_latent_attention=m.model_family == "deepseek-mla",
        num_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size, tokenizer_type=config.data.tokenizer_type,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        use_distributed_optimizer=p.use_distributed_optimizer,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
        train_iters=t.train_iters, train_samples=t.train_samples,
        consumed_train_samples=step * t.global_batch_size, skipped_train_samples=0,
        consumed_valid_samples=0, iteration=step, bf16=t.bf16, fp16=False, seed=t.seed,
        ckpt_format="torch_dist", data_parallel_random_init=False)


def sharded_state(trainer, is_loading: bool, with_rank_state: bool, form: dict) -> dict:
    """The sharded part (model, optimizer in `form`, this rank's own state)."""
    model = unwrap(trainer.model[0]).sharded_state_dict()  # as Megatron-LM: the bare model
    with zero_adam_state(trainer.optimizer) if is_loading else contextlib.nullcontext():
        optimizer = trainer.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                         metadata=form)
    # TE's pickled FP8 metadata: written empty, never read (te_extra_state.py)
    state = {"model": te_extra_state.not_read(model) if is_loading else
             te_extra_state.written_empty(model), "optimizer": optimizer}
    if with_rank_state:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        data = None if is_loading else to_plain({"rng": rng_state(),
                                                 "monitors": trainer.monitors.state_dict()})
        state["rank_state"] = ShardedObject(RANK_STATE, data, (world,), (rank,), replica_id=0)
    return state


def common_state(trainer, step: int, settings: dict, padded_vocab_size: int,
                 flops_per_step: float) -> dict:
    monitors = trainer.monitors.state_dict()
    return {
        "args": megatron_args(trainer.config, step, padded_vocab_size),
        "checkpoint_version": 3.0,
        "iteration": step,
        "opt_param_scheduler": trainer.scheduler.state_dict(),
        "num_floating_point_operations_so_far": float(step * flops_per_step),
        "megatron_gnmr": to_plain({
            "run_state": trainer.state.state_dict(),
            "controller": trainer.controller.state_dict(),
            "alarms": monitors["alarms"] if monitors else None,
            "layout": layout(trainer.config),
            "optimizer_form": optimizer_form(trainer.config.checkpoint),
            "settings": settings,
        }),
    }


def unpack_rank_state(loaded) -> dict:
    return from_plain(loaded)
