"""The torch_dist format (the default) keeps the present format's promises, in-process: a
corrupt file is passed over for the newest intact checkpoint, crafted files run no code (the
index that torch would unpickle, a byte item torch would load with weights_only=False, a
common.pt), and megatron-core's own loader reads the checkpoint into a GPTModel built the
way Megatron-LM builds one."""

import hashlib
import io
import json
import shutil
import pickle
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY, pretrain_in_process, read_jsonl, train_losses

FAST = [*TINY, "--eval-interval", "100", "--lr-warmup-iters", "1"]


class CreatesAFileWhenUnpickled:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _vouch(directory: Path, name: str) -> None:
    """Rewrite the manifest so that it vouches for `name` as it is now (an attacker who can
    write the checkpoint can write its manifest too)."""
    manifest = json.loads((directory / "megatron_gnmr.json").read_text())
    data = (directory / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / "megatron_gnmr.json").write_text(json.dumps(manifest))


@pytest.fixture
def two_checkpoints(tmp_path):
    run = tmp_path / "run"
    assert pretrain_in_process([*FAST, "--train-iters", "6", "--exit-interval", "4",
                                "--save-interval", "2", "--keep-last", "3",
                                "--save", str(run)]) == 0
    assert sorted(p.name for p in run.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    return run


def test_a_corrupt_file_falls_back_to_the_newest_intact_checkpoint(two_checkpoints, capfd):
    run = two_checkpoints
    shard = next((run / "iter_0000004").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit, the same size: only the hash can tell
    shard.write_bytes(bytes(data))
    capfd.readouterr()
    assert pretrain_in_process([*FAST, "--train-iters", "6", "--save-interval", "2",
                                "--keep-last", "3", "--resume", "auto", "--save",
                                str(run)]) == 0
    records = read_jsonl(run / "metrics.jsonl")
    warnings = [r for r in records if r.get("event") == "warning"]
    assert len(warnings) == 1 and "iter_0000004" in warnings[0]["checkpoint"]
    assert "sha256" in warnings[0]["checkpoint"]
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert resumed[-1]["path"].endswith("iter_0000002") and max(train_losses(run)) == 6


@pytest.mark.parametrize("target", [".metadata", "byte item", "common.pt"])
def test_a_crafted_file_runs_no_code(two_checkpoints, capfd, target):
    """The payload would create a file when unpickled; the manifest vouches for it. Loading
    is refused with one line, and nothing is created."""
    run = two_checkpoints
    directory = run / "iter_0000004"
    marker = run.parent / "pwned"
    payload = CreatesAFileWhenUnpickled(str(marker))
    if target == ".metadata":
        (directory / ".metadata").write_bytes(pickle.dumps(payload))
        name = ".metadata"
    elif target == "common.pt":
        torch.save({"megatron_gnmr": payload}, directory / "common.pt")
        name = "common.pt"
    else:  # a ShardedObject's bytes (this rank's own state), rewritten in place
        name = _rewrite_byte_item(directory, payload)
    _vouch(directory, name)
    shutil.rmtree(run / "iter_0000002")  # no fallback: a one-line refusal
    capfd.readouterr()
    code = pretrain_in_process([*FAST, "--train-iters", "6", "--resume", "auto", "--save",
                                str(run)])
    err = capfd.readouterr().err
    assert code == 2 and not marker.exists(), err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "iter_0000004" in errors[0], err[-2000:]
    pickle.loads(pickle.dumps(payload))  # proof the payload was real
    assert marker.exists()


def _rewrite_byte_item(directory: Path, payload) -> str:
    """Replace the bytes of the checkpoint's largest byte item (megatron's ShardedObjects are
    torch.save'd into the .distcp files) with a same-length pickle of `payload`."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_gnmr.checkpoints.torch_dist.data_only import read_index

    with open(directory / ".metadata", "rb") as stream:
        index = read_index(stream)
    keys = {k for k, v in index.state_dict_metadata.items()
            if isinstance(v, BytesStorageMetadata)}
    info = max((v for k, v in index.storage_data.items() if k.fqn in keys),
               key=lambda v: v.length)  # the largest, for the payload to fit
    path = directory / info.relative_path
    data = bytearray(path.read_bytes())
    buffer = io.BytesIO()
    torch.save([payload], buffer, _use_new_zipfile_serialization=False)  # the smaller form
    evil = buffer.getvalue()
    assert len(evil) <= info.length, "the payload must fit the item"
    evil += b"\0" * (info.length - len(evil))
    data[info.offset: info.offset + info.length] = evil
    path.write_bytes(bytes(data))
    return path.name


def test_megatron_core_reads_it_into_a_model_built_as_megatron_lm_builds_one(tmp_path):
    """Megatron-LM builds a LLaMA with megatron-core's local layer spec (RMSNorm, SwiGLU,
    RoPE, no bias, untied; `gpt_builders.py`); megatron-core's `dist_checkpointing.load`
    fills that model from our checkpoint, and every weight equals the one our run saved.
    The common state (common.pt with megatron-core 0.16, a byte item with 0.19, read by
    megatron-core's `load_common_state_dict`) holds what Megatron-LM's loader reads first."""
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    run = tmp_path / "run"
    assert pretrain_in_process([*FAST, "--train-iters", "3", "--save", str(run)]) == 0
    directory = run / "iter_0000003"
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg",
                                         rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(7)
        common = dist_checkpointing.load_common_state_dict(str(directory))  # megatron's own
        args = common["args"]
        config = TransformerConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size,
            ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            layernorm_epsilon=args.norm_epsilon, use_cpu_initialization=True)
        model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=args.padded_vocab_size,
                         max_sequence_length=args.max_position_embeddings,
                         position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(directory))
        model.load_state_dict(loaded["model"])
        assert common["iteration"] == 3 and common["checkpoint_version"] == 3.0
        assert args.consumed_train_samples == 3 * args.global_batch_size
        assert set(common["opt_param_scheduler"]) >= {"max_lr", "num_steps"}
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    ours = _our_weights(run, tmp_path)
    theirs = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert ours.keys() == theirs.keys() and len(ours) == 15
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


def _our_weights(run: Path, tmp_path: Path) -> dict:
    """The weights the run holds, read back by the run's own code (evaluate's loader)."""
    from megatron_gnmr.evaluation.loaded_run import load_run
    from megatron_gnmr.model import unwrap
    from megatron_gnmr.training import distributed

    loaded = load_run(str(run))
    try:
        return {k: v.detach().clone() for k, v in unwrap(loaded.model[0]).state_dict().items()
                if not k.endswith("_extra_state")}
    finally:
        distributed.shutdown()


def test_ckpt_step_loads_that_step_or_says_which_exist(two_checkpoints, capfd):
    """Megatron-LM's --ckpt-step: that step's checkpoint, not the newest; a step with no
    checkpoint is refused naming the steps there (never a silent fallback)."""
    run, again = two_checkpoints, two_checkpoints.parent / "again"
    capfd.readouterr()
    assert pretrain_in_process([*FAST, "--train-iters", "6", "--load", str(run),
                                "--ckpt-step", "3", "--save", str(again)]) == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--ckpt-step 3" in errors[0] and "2, 4" in errors[0]
    assert pretrain_in_process([*FAST, "--train-iters", "6", "--load", str(run),
                                "--ckpt-step", "2", "--save", str(again)]) == 0
    resumed = [r for r in read_jsonl(again / "metrics.jsonl") if r.get("event") == "resumed"]
    assert resumed[0]["path"].endswith("iter_0000002") and sorted(train_losses(again)) == [3, 4, 5, 6]
