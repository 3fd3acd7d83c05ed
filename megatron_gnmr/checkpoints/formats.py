"""The checkpoint formats as data: one object per `--ckpt-format`, and every caller asks it.

megatron-core keeps one registry of save and load strategies keyed by backend and version
(`dist_checkpointing/strategies/base.py`: `default_strategies[action][(backend, version)]`),
and its core asks a strategy what it can do (`can_handle_sharded_objects`) instead of
comparing a backend's name. The same here: each format is one object holding what differs
between the formats (where its checkpoints are, how to tell a complete one, how it is
checked, saved and restored, how large it is, and what it can do: `reshards`,
`sharded_save`), `FORMATS` is the table, and code outside this file never compares a
format's name (tests/test_checkpoint_formats.py holds that count at 0).

- `torch`: one file per rank under `<run>/checkpoints/iter_*` (`per_rank.py`), exact for the
  layout that wrote it and refused on another;
- `torch_dist` (the default): megatron-core's `dist_checkpointing` in Megatron-LM's layout,
  `<run>/iter_*` (`torch_dist/`), resharded on load to any layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from megatron_gnmr.checkpoints import per_rank
from megatron_gnmr.checkpoints.torch_dist import files as dist_files
from megatron_gnmr.model_families.parameter_count import whole_model_parameters


class CheckpointFormat(ABC):
    """What one format is and does (each abstract method: every format has its own). Collective
    methods say so."""

    name: str
    reshards: bool
    """Loads onto another layout (TP, PP, EP, DP size), the model and optimizer resharded;
    otherwise only onto the layout that wrote it."""
    sharded_save: bool
    """Written through megatron-core's `dist_checkpointing`: --async-save,
    --ckpt-fully-parallel-load, the optimizer's reshardable forms and the host memory a save
    stages (`size.host_bytes_per_rank`) apply to it alone."""
    description: str
    """The file in a checkpoint that records every other file's size and sha256."""

    @abstractmethod
    def candidates(self, load: str) -> list[Path]:
        """What `--load`/`--resume auto` may load, in order (an `iter_*` directory given
        directly; else the one the format's pointer names, then the others newest first)."""
        ...

    @abstractmethod
    def step_of(self, path: Path) -> int | None:
        ...

    @abstractmethod
    def checkpoint_steps(self, run_dir: str) -> list[int]:
        """Every complete checkpoint's step in a run directory."""
        ...

    @abstractmethod
    def expected(self, load: str) -> str:
        """Where its checkpoints would be, for a "none there" message."""
        ...

    @abstractmethod
    def problem_on_disk(self, directory: Path) -> str | None:
        """Why `directory` cannot be loaded, from its description and file sizes; None."""
        ...

    @abstractmethod
    def record(self, directory: Path) -> dict:
        """Its description: the settings it was written with (`settings`), its step, ..."""
        ...

    @abstractmethod
    def hashes_match(self, directory: Path) -> bool:
        """Collective: every file this rank checks has the sha256 its description records."""
        ...

    def hashes_pending(self, directory: Path) -> str | None:
        """A warning where the hashes could not be checked (None: they were)."""
        return None

    @abstractmethod
    def main_weight_written(self, config) -> bool:
        """Whether the optimizer state written holds an fp32 main weight besides Adam's two
        moments (bf16 always does)."""
        ...

    @abstractmethod
    def bytes_written(self, config, world_size: int) -> float:
        """What one checkpoint writes, summed over every rank (`size.py`)."""
        ...

    @abstractmethod
    def save(self, run, step: int, asynchronous=None, published=None,
             publish_first=None) -> Path | None:
        """Collective: the trainer's checkpoint of `step` (`run`: its
        `training.resume.RunCheckpoints`). None while an async save is in flight."""
        ...

    @abstractmethod
    def read_saved(self, directory: Path) -> dict:
        """What a resume checks before it restores (`settings`, and what `restore` needs)."""
        ...

    @abstractmethod
    def restore(self, run, directory: Path, saved: dict) -> list[str]:
        """Collective: `directory` into the trainer; returns the start notice's lines."""
        ...

    def __repr__(self) -> str:
        return f"<checkpoint format {self.name}>"


def state_bytes(config, fmt: CheckpointFormat) -> int:
    """Optimizer bytes a checkpoint writes per parameter: Adam's two fp32 moments, and an
    fp32 main weight where the format writes one."""
    return 8 + (4 if config.training.bf16 or fmt.main_weight_written(config) else 0)


def _data_parallel_size(config, world_size: int) -> int:
    p = config.parallel
    return max(world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size),
               1)


def _weight_bytes(config) -> int:
    return 2 if config.training.bf16 else 4


class TorchFormat(CheckpointFormat):
    name, reshards, sharded_save, description = "torch", False, False, "meta.json"

    def candidates(self, load: str) -> list[Path]:
        return per_rank.candidates(load)

    def step_of(self, path: Path) -> int | None:
        return per_rank.step_of(path)

    def checkpoint_steps(self, run_dir: str) -> list[int]:
        return per_rank.checkpoint_steps(run_dir)

    def expected(self, load: str) -> str:
        return f"{per_rank.checkpoint_root(load)}/iter_* with meta.json"

    def problem_on_disk(self, directory: Path) -> str | None:
        return per_rank.intact_on_disk(directory)

    def record(self, directory: Path) -> dict:
        return per_rank.read_meta(directory)

    def hashes_match(self, directory: Path) -> bool:
        from megatron_gnmr.platform.device import run_device

        intact = torch.tensor([per_rank.shard_matches(directory, torch.distributed.get_rank())],
                              device=run_device())
        torch.distributed.all_reduce(intact, op=torch.distributed.ReduceOp.MIN)
        return int(intact) == 1

    def main_weight_written(self, config) -> bool:
        return False  # the distributed optimizer's views of the weights are left out

    def bytes_written(self, config, world_size: int) -> float:
        """Every data-parallel replica writes its model shard, and its optimizer state too
        unless the distributed optimizer splits that over the replicas."""
        dp, parameters = _data_parallel_size(config, world_size), whole_model_parameters(config)
        return dp * parameters * _weight_bytes(config) + \
            (1 if config.parallel.use_distributed_optimizer else dp) * parameters * \
            state_bytes(config, self)

    def save(self, run, step: int, asynchronous=None, published=None,
             publish_first=None) -> Path | None:
        trainer = run.trainer
        return per_rank.save_checkpoint(trainer.run_dir, step, run.per_rank_shard(),
                                        run.per_rank_meta(), trainer.config.checkpoint.keep_last,
                                        trainer.faults)

    def read_saved(self, directory: Path) -> dict:
        return per_rank.read_meta(directory)

    def restore(self, run, directory: Path, saved: dict) -> list[str]:
        return run.restore_shard(directory, per_rank.load_shard(directory))


class TorchDistFormat(CheckpointFormat):
    name, reshards, sharded_save, description = "torch_dist", True, True, dist_files.MANIFEST

    def candidates(self, load: str) -> list[Path]:
        return dist_files.candidates(load)

    def step_of(self, path: Path) -> int | None:
        return dist_files.step_of(path)

    def checkpoint_steps(self, run_dir: str) -> list[int]:
        return dist_files.checkpoint_steps(run_dir)

    def expected(self, load: str) -> str:
        return f"{load}/iter_* with {dist_files.MANIFEST}"

    def problem_on_disk(self, directory: Path) -> str | None:
        return dist_files.problem_on_disk(directory)

    def record(self, directory: Path) -> dict:
        return dist_files.read_manifest(directory)

    def hashes_match(self, directory: Path) -> bool:
        return dist_files.hashes_match(directory)

    def hashes_pending(self, directory: Path) -> str | None:
        return dist_files.hashes_pending(directory)

    def main_weight_written(self, config) -> bool:
        # the distributed optimizer's torch_dist state names `param` in fp32 too: a view of
        # the weight, written a second time
        return config.parallel.use_distributed_optimizer

    def bytes_written(self, config, world_size: int) -> float:
        """Every tensor once, whatever the layout (the fully parallel save spreads the
        writing over the data-parallel replicas)."""
        parameters = whole_model_parameters(config)
        return parameters * (_weight_bytes(config) + state_bytes(config, self))

    def save(self, run, step: int, asynchronous=None, published=None,
             publish_first=None) -> Path | None:
        from megatron_gnmr.checkpoints.torch_dist import run as dist_run

        trainer = run.trainer
        return dist_run.save(trainer, step, run.settings(), trainer.padded_vocab_size,
                             trainer.flops_per_step, trainer.faults, asynchronous, published,
                             publish_first)

    def read_saved(self, directory: Path) -> dict:
        from megatron_gnmr.checkpoints.torch_dist import run as dist_run

        return dist_run.read_saved(directory)

    def restore(self, run, directory: Path, saved: dict) -> list[str]:
        return run.restore_sharded(directory, saved)


TORCH, TORCH_DIST = TorchFormat(), TorchDistFormat()
FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (TORCH, TORCH_DIST)}
"""Every format. The order breaks a tie when a run directory holds checkpoints of one step in
both formats (`choice.py`: the torch one first, as it always was)."""


def checkpoint_format(name: str) -> CheckpointFormat:
    """The format `--ckpt-format NAME` names (the config has checked the name)."""
    return FORMATS[name]


def format_of(directory: Path) -> CheckpointFormat | None:
    """The format of one checkpoint directory, by the description it holds."""
    return next((f for f in FORMATS.values() if (Path(directory) / f.description).is_file()),
                None)
