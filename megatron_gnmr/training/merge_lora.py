"""`megatron-gnmr merge-lora RUN_DIR --out MERGED_DIR`: a LoRA run's adapters merged into its
base weights, written as a run of its own (config.json without LoRA, one checkpoint with the
model weights only, the same layout), so that it can be evaluated, served from, or given to
`--finetune --load` like any pretrained run.

Over a base of per-rank shards (the torch format): offline, one process reads every rank's
shard (hash-checked), and TP groups are the runs of `tp` consecutive ranks (megatron's
default rank order puts tensor parallelism innermost). Over a torch_dist base (the default
format): a launch of the fine-tune's process count reads the base into the fine-tune's
layout and writes the merged weights as torch_dist.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megatron_gnmr.checkpoints import per_rank
from megatron_gnmr.config import RunConfig
from megatron_gnmr.errors import UserError
from megatron_gnmr.lora.merge import merge_group
from megatron_gnmr.model_families import row_parallel_linears
from megatron_gnmr.training.finetune import recorded_base


def merge_run(run_dir: str, out: str) -> Path:
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"merge-lora --out {out}: "
                        f"{'is not empty' if target.is_dir() else 'is a file'}; the merged "
                        "run needs a new directory")
    directory = per_rank.newest_intact(run_dir)
    if directory is None:
        raise UserError(f"merge-lora {run_dir}: no complete checkpoint there")
    meta = per_rank.read_meta(directory)
    lora = meta.get("lora")
    if not lora:
        raise UserError(f"merge-lora {run_dir}: {directory} is not a LoRA run's checkpoint")
    config = json.loads((Path(run_dir) / "config.json").read_text())
    tp = config["parallel"]["tensor_model_parallel_size"]
    world = meta["world_size"]
    scale = lora["alpha"] / lora["dim"]
    row_parallel = row_parallel_linears(RunConfig.from_dict(config))
    merged_config = RunConfig.from_dict(config).to_dict()  # in today's sections
    merged_config["lora"]["enabled"] = False
    merged_config["checkpoint"]["finetune"] = False
    settings = {k: v for k, v in meta["settings"].items() if not k.startswith("--lora")
                and not k.startswith("base checkpoint")}
    settings["--lora"] = False
    base_dir = recorded_base(lora, f"merge-lora {run_dir}") if lora.get("base") else None
    if base_dir is not None and not (base_dir / "meta.json").is_file():
        path = _merge_over_resharded_base(run_dir, directory, meta, base_dir, config,
                                          merged_config, settings, out)
    else:
        adapters = [per_rank.read_shard(directory, rank)["model"][0] for rank in range(world)]
        # an adapters-only fine-tune's weights are its base's
        bases = adapters if base_dir is None else \
            [per_rank.read_shard(base_dir, rank)["model"][0] for rank in range(world)]
        merged = []
        for first in range(0, world, tp):
            group = slice(first, first + tp)
            merged.extend(merge_group(bases[group], adapters[group], scale, row_parallel))
        path = per_rank.write_checkpoint(out, meta["step"], [{"model": [m]} for m in merged],
                                           {"settings": settings,
                                            "merged_from": str(directory)})
    if path is not None:  # the writing rank
        (target / "config.json").write_text(json.dumps(merged_config, indent=2))
    return path


def _merge_over_resharded_base(run_dir: str, directory: Path, meta: dict, base_dir: Path,
                               config: dict, merged_config: dict, settings: dict,
                               out: str) -> Path | None:
    """Collective, launched with the fine-tune's process count: a torch_dist base is read by
    megatron-core into the fine-tune's layout, each rank adds its TP group's adapters (the
    group's shards all-gathered) and the merged weights are saved as a torch_dist checkpoint
    (resharded on load, like any). Returns the checkpoint on rank 0, None elsewhere."""
    from megatron.core import parallel_state

    from megatron_gnmr.checkpoints.torch_dist import run as dist_run
    from megatron_gnmr.config import launch_world_size
    from megatron_gnmr.data.datasets import tokenizer_of
    from megatron_gnmr.lora.merge import merge_shard
    from megatron_gnmr.model import build_model, unwrap
    from megatron_gnmr.platform.device import run_device
    from megatron_gnmr.training import distributed
    from megatron_gnmr.training.finetune import is_adapter_key, load_adapters
    from megatron_gnmr.training.run_state import RunState

    if launch_world_size() != meta["world_size"]:
        raise UserError(f"merge-lora {run_dir}: its base is a torch_dist checkpoint, read into "
                        f"the fine-tune's layout: launch the merge with its "
                        f"{meta['world_size']} processes (torchrun --nproc_per_node "
                        f"{meta['world_size']} -m megatron_gnmr.cli merge-lora ...)")
    tuned = RunConfig.from_dict(config)
    if tuned.parallel.pipeline_model_parallel_size > 1:
        raise UserError(f"merge-lora {run_dir}: a pipeline-parallel fine-tune over a torch_dist "
                        "base is not merged yet")
    tuned.checkpoint.save = tuned.checkpoint.load = None
    distributed.initialize(tuned)
    try:
        vocab = tokenizer_of(tuned.data).vocab_size
        model = build_model(tuned, vocab, for_training=False)
        dist_run.load_model_weights(model, base_dir, f"the base {base_dir}",
                                    not_in_checkpoint=is_adapter_key)
        load_adapters(model[0], per_rank.load_shard(directory)["model"][0],
                      f"merge-lora {run_dir}")
        state = unwrap(model[0]).state_dict()
        group = [None] * parallel_state.get_tensor_model_parallel_world_size()
        # pickled with the tensors' device, a GPU tensor would come back on the sender's
        # GPU: the adapters cross as host copies and return to the run's device
        torch.distributed.all_gather_object(
            group, {k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()
                    if is_adapter_key(k)},
            group=parallel_state.get_tensor_model_parallel_group())
        group = [{k: v.to(run_device()) if torch.is_tensor(v) else v for k, v in part.items()}
                 for part in group]
        merged = merge_shard(state, group, parallel_state.get_tensor_model_parallel_rank(),
                             tuned.lora.alpha / tuned.lora.dim,
                             row_parallel_linears(tuned))
        plain = RunConfig.from_dict(merged_config)
        target = build_model(plain, vocab, for_training=False)
        live = unwrap(target[0]).state_dict()
        unwrap(target[0]).load_state_dict(
            {**{k: v for k, v in live.items() if k.endswith("_extra_state")},
             **{k: v for k, v in merged.items() if not k.endswith("_extra_state")}})
        path = dist_run.save_weights(target, out, settings, plain, RunState().state_dict())
        return path if torch.distributed.get_rank() == 0 else None
    finally:
        distributed.shutdown()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a LoRA run directory")
    parser.add_argument("--out", required=True, help="the merged run's directory (new)")


def run(args: argparse.Namespace) -> None:
    path = merge_run(args.run_dir, args.out)
    if path is not None:  # the writing rank of a launch
        print(f"merge-lora: merged weights written to {path}")
