"""`megatron-gnmr merge-lora RUN_DIR --out MERGED_DIR`: a LoRA run's adapters merged into its
base weights, written as a run of its own (config.json without LoRA, one checkpoint with the
model weights only, the same layout), so that it can be evaluated, served from, or given to
`--finetune --load` like any pretrained run.

Offline: one process reads every rank's shard (hash-checked), and TP groups are the runs of
`tp` consecutive ranks (megatron's default rank order puts tensor parallelism innermost).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_gnmr.config import RunConfig
from megatron_gnmr.errors import UserError
from megatron_gnmr.lora.merge import merge_group
from megatron_gnmr.model_families import row_parallel_linears
from megatron_gnmr.training import checkpoint
from megatron_gnmr.training.finetune import recorded_base


def merge_run(run_dir: str, out: str) -> Path:
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"merge-lora --out {out}: "
                        f"{'is not empty' if target.is_dir() else 'is a file'}; the merged "
                        "run needs a new directory")
    directory = checkpoint.newest_intact(run_dir)
    if directory is None:
        raise UserError(f"merge-lora {run_dir}: no complete checkpoint there")
    meta = checkpoint.read_meta(directory)
    lora = meta.get("lora")
    if not lora:
        raise UserError(f"merge-lora {run_dir}: {directory} is not a LoRA run's checkpoint")
    config = json.loads((Path(run_dir) / "config.json").read_text())
    tp = config["parallel"]["tensor_model_parallel_size"]
    world = meta["world_size"]
    adapters = [checkpoint.read_shard(directory, rank)["model"][0] for rank in range(world)]
    if lora.get("base"):  # an adapters-only fine-tune: the weights are its base's
        base_dir = recorded_base(lora, f"merge-lora {run_dir}")
        if not (base_dir / "meta.json").is_file():
            raise UserError(f"merge-lora {run_dir}: its base {base_dir} is a torch_dist "
                            "checkpoint; merge-lora reads a base of per-rank shards (write the "
                            "base with --ckpt-format torch, or evaluate the fine-tune as it is)")
        bases = [checkpoint.read_shard(base_dir, rank)["model"][0] for rank in range(world)]
    else:
        bases = adapters
    scale = lora["alpha"] / lora["dim"]
    row_parallel = row_parallel_linears(RunConfig.from_dict(config))
    merged = []
    for first in range(0, world, tp):
        group = slice(first, first + tp)
        merged.extend(merge_group(bases[group], adapters[group], scale, row_parallel))
    config["lora"]["enabled"] = False
    config["training"]["finetune"] = False
    settings = {k: v for k, v in meta["settings"].items() if not k.startswith("--lora")
                and not k.startswith("base checkpoint")}
    settings["--lora"] = False
    path = checkpoint.write_checkpoint(out, meta["step"], [{"model": [m]} for m in merged],
                                       {"settings": settings, "merged_from": str(directory)})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a LoRA run directory")
    parser.add_argument("--out", required=True, help="the merged run's directory (new)")


def run(args: argparse.Namespace) -> None:
    path = merge_run(args.run_dir, args.out)
    print(f"merge-lora: merged weights written to {path}")
