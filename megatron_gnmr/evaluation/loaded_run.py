"""A finished run's model, rebuilt from its config.json and loaded from its newest intact
checkpoint (a LoRA fine-tune: its base, checked against the recorded hash, then its
adapters), in the precision a deployment would run: every unit on the run's low-cost path
(as a fixed-recipe run trained), or on the recovery path with `exact`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_gnmr.checkpoints import per_rank
from megatron_gnmr.checkpoints.choice import choose, newest_format
from megatron_gnmr.config import RunConfig
from megatron_gnmr.controller.units import UnitShape, local_unit_modules
from megatron_gnmr.data.datasets import DataSource, build_datasets, resolve_data, tokenizer_of
from megatron_gnmr.errors import UserError
from megatron_gnmr.model import bind_precision, build_model
from megatron_gnmr.platform.device import run_device
from megatron_gnmr.precision.plan import PrecisionPlan
from megatron_gnmr.precision.kept_high import kept_high
from megatron_gnmr.training.finetune import (
    is_adapter_key,
    load_adapters,
    load_weights,
    recorded_base,
)
from megatron_gnmr.training.resume import load_model_state



def run_config(run_dir: Path) -> RunConfig:
    path = run_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{run_dir}: no config.json (not a run directory, or the run never "
                        "started)")
    config = RunConfig.from_dict(json.loads(path.read_text()))
    config.checkpoint.save = config.checkpoint.load = None
    return config


@dataclass
class LoadedRun:
    run_dir: Path
    config: RunConfig
    model: list[torch.nn.Module]
    data: DataSource
    base_run: Path | None  # a LoRA fine-tune's base run directory

    @property
    def batch(self) -> int:
        """Sequences per forward pass: the run's micro-batch, which it was trained to fit
        (a whole evaluation set at once would not, at a real model's size and context)."""
        return self.config.training.micro_batch_size

    @torch.no_grad()
    def token_losses(self, rows: list[list[int]]) -> list[np.ndarray]:
        """Per-position next-token loss of each row: entry t is -log p(row[t+1] | row[:t+1])."""
        out = []
        for start in range(0, len(rows), self.batch):
            batch = rows[start: start + self.batch]
            width = max(len(r) for r in batch) - 1
            filler = self.data.tokenizer.pad if self.data.tokenizer.pad >= 0 else \
                self.data.tokenizer.eod  # a tokenizer without a pad id (-1): any real id
            tokens = torch.full((len(batch), width), filler, dtype=torch.long)
            labels = torch.full_like(tokens, filler)
            for i, row in enumerate(batch):
                tokens[i, : len(row) - 1] = torch.tensor(row[:-1])
                labels[i, : len(row) - 1] = torch.tensor(row[1:])
            losses = self.losses(tokens, labels)
            out.extend(losses[i, : len(row) - 1].numpy() for i, row in enumerate(batch))
        return out

    @torch.no_grad()
    def losses(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """megatron's per-token loss [batch, positions] (vocab-parallel under TP)."""
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        device = run_device()
        loss = self.model[0](tokens.to(device), positions.to(device), None,
                             labels=labels.to(device))
        return loss.float().cpu()

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole (padded) vocabulary's logits [batch, positions, vocab], float32 on the
        host: under TP each rank's vocabulary slice, gathered."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        device = run_device()
        local = self.model[0](tokens.to(device), positions.to(device), None)
        return gather_from_tensor_model_parallel_region(local).float().cpu()

    def valid_split(self, config: RunConfig | None = None, sequences: int = 64, seed: int = 0):
        """The held-out GPTDataset of this run's data (or another config's), its sequences in
        the order `seed` gives (one seed for every run of a comparison: the same questions)."""
        config = config or self.config
        source = resolve_data(config.data) if config is not self.config else self.data
        _, valid = build_datasets(config.data, source, config.model.seq_length, seed,
                                  train_samples=1, valid_samples=sequences)
        return valid


def _held_out_data(config: RunConfig, data_path: list[str] | None) -> DataSource:
    """The run's own data, or the indexed files of `data_path` (a blend in Megatron-LM's
    form) read with the run's tokenizer: an imported model has no data of its own."""
    if not data_path:
        return resolve_data(config.data)
    from megatron_gnmr.data.indexed import check_indexed_dataset
    from megatron_gnmr.data.sources import check_prefixes, plan_from

    tokenizer = tokenizer_of(config.data)
    config.data.data_path = list(data_path)
    plan = plan_from(config.data)
    for prefix in dict.fromkeys(plan.prefixes):
        check_indexed_dataset(prefix, flag="--data-path")
    check_prefixes(plan, tokenizer.vocab_size)
    return DataSource(plan, None, tokenizer, None)


def unsplit(config: RunConfig) -> None:
    """The run's model in one piece (no TP, PP, EP, distributed optimizer or overlap): what
    a torch_dist checkpoint of any layout is read into in one process."""
    p = config.parallel
    p.tensor_model_parallel_size = p.pipeline_model_parallel_size = 1
    p.expert_model_parallel_size = 1
    p.use_distributed_optimizer = p.sequence_parallel = False
    p.overlap_grad_reduce = p.overlap_param_gather = False


def load_run(run_dir: str, exact: bool = False, data_path: list[str] | None = None) -> LoadedRun:
    """Collective (every rank of the launch): the run's model with its trained weights (and
    its held-out data: its own, or `data_path`'s)."""
    from megatron_gnmr.training import distributed

    directory = Path(run_dir)
    config = run_config(directory)
    p = config.parallel
    newest = newest_format(str(directory))
    if newest is not None and newest.reshards and \
            int(os.environ.get("WORLD_SIZE", "1")) % p.tensor_model_parallel_size:
        unsplit(config)  # resharded on load: a launch too small for the layout reads it whole
    if p.pipeline_model_parallel_size > 1:
        raise UserError(f"evaluate {run_dir}: pipeline-parallel runs are not supported yet")
    distributed.initialize(config)
    data = _held_out_data(config, data_path)
    model = build_model(config, data.tokenizer.vocab_size, for_training=False)
    shape = UnitShape.of(config)
    plan = PrecisionPlan(all_recovery=exact or config.precision.precision_static == "recovery",
                         always=kept_high(config.precision, shape.names()))
    bind_precision(local_unit_modules(model, shape), config, plan)
    choice = choose(str(directory))
    if choice.format.reshards:  # resharded to this launch, whatever its size
        from megatron_gnmr.checkpoints.torch_dist import run

        _check_recorded_shape(run_dir, config, choice.format.record(choice.directory))
        run.load_model_weights(model, choice.directory, f"evaluate {run_dir}")
        for chunk in model:
            chunk.eval()
        return LoadedRun(directory, config, model, data, None)
    meta = per_rank.read_meta(choice.directory)
    if meta.get("world_size") != torch.distributed.get_world_size():
        raise UserError(f"evaluate {run_dir}: its checkpoint was written by "
                        f"{meta.get('world_size')} processes; launch the evaluation with as many "
                        "(torchrun --nproc_per_node N -m megatron_gnmr.cli evaluate RUN_DIR)")
    _check_recorded_shape(run_dir, config, meta)
    base_run = _load_weights(model, choice.directory, meta)
    for chunk in model:
        chunk.eval()
    return LoadedRun(directory, config, model, data, base_run)


def _check_recorded_shape(run_dir: str, config: RunConfig, meta: dict) -> None:
    """The model config.json describes is the one the checkpoint holds (meta.json records
    every model field): a mismatch would end in a tensor size error inside torch."""
    import dataclasses

    from megatron_gnmr.config import ModelConfig, flag_name

    saved = meta.get("settings") if isinstance(meta.get("settings"), dict) else {}
    for field in dataclasses.fields(ModelConfig):
        flag = flag_name("model", field.name)
        ours = getattr(config.model, field.name)
        if flag in saved and saved[flag] != ours:
            raise UserError(f"evaluate {run_dir}: its config.json says {flag} {ours}, its "
                            f"checkpoint was written with {saved[flag]}; the run directory "
                            "is inconsistent (was config.json edited or copied from another "
                            "run?)")


def _load_weights(model, directory: Path, meta: dict) -> Path | None:
    shard = per_rank.load_shard(directory)
    if "lora" not in meta:
        for chunk, state in zip(model, shard["model"], strict=True):
            load_model_state(chunk, state)
        return None
    base = recorded_base(meta["lora"], f"evaluate {directory}")
    if choose(str(base)).format.reshards:  # every rank checks its share of the files
        from megatron_gnmr.checkpoints.torch_dist import run

        run.load_model_weights(model, base, f"the base {base}", not_in_checkpoint=is_adapter_key)
        for chunk, adapters in zip(model, shard["model"], strict=True):
            load_adapters(chunk, adapters, f"evaluate {directory}")
        return base.parent  # <run>/iter_*
    base_shard = per_rank.load_shard(base)  # hash-checked by `choose` above
    for chunk, state, adapters in zip(model, base_shard["model"], shard["model"], strict=True):
        load_weights(chunk, state, f"the base {base}")
        load_adapters(chunk, adapters, f"evaluate {directory}")
    return base.parent.parent  # <run>/checkpoints/iter_*
