"""Logits of checkpoints read on two processes (torchrun): each rank builds the model at
the job's layout (TP 2 by default, or EP 2 for a MoE model: each rank holds half the
experts and the tokens travel to them), megatron-core reshards the checkpoint into it, and
the vocabulary-parallel logits are gathered; rank 0 saves them. A job that raises writes its
traceback to LOGITS.pt.error instead and the launch goes on to the next job, so one family's
failure is its own test's, not every test's of the launch.

    torchrun --nproc_per_node=2 hf_logits_worker.py JOBS.json
    # JOBS.json: [[checkpoint directory (with config.json), tokens.pt, logits.pt
    #              (, {"tp": 2} or {"ep": 2})], ...]
"""

import json
import os
import sys
from pathlib import Path

import torch


def main(path: str) -> None:
    import traceback

    from megatron.core import parallel_state

    from megatron_gnmr.training import distributed

    for directory, tokens_file, out_file, *layout in json.loads(open(path).read()):
        try:
            _logits(directory, tokens_file, out_file, layout[0] if layout else {"tp": 2})
        except Exception:  # noqa: BLE001 - reported to the job's own test
            if os.environ.get("RANK", "0") == "0":
                Path(f"{out_file}.error").write_text(traceback.format_exc())
        parallel_state.destroy_model_parallel()
    distributed.shutdown()


def _logits(directory: str, tokens_file: str, out_file: str, layout: dict) -> None:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_gnmr.checkpoints.choice import choose
    from megatron_gnmr.checkpoints.torch_dist.run import load_model_weights
    from megatron_gnmr.data.datasets import tokenizer_of
    from megatron_gnmr.evaluation.loaded_run import run_config
    from megatron_gnmr.model import build_model, unwrap
    from megatron_gnmr.training import distributed

    config = run_config(Path(directory))
    config.parallel.tensor_model_parallel_size = layout.get("tp", 1)
    config.parallel.expert_model_parallel_size = layout.get("ep", 1)
    config.parallel.pipeline_model_parallel_size = 1
    config.parallel.sequence_parallel = False
    config.parallel.use_distributed_optimizer = False
    distributed.initialize(config)
    model = build_model(config, tokenizer_of(config.data).vocab_size)
    choice = choose(directory)
    assert choice.format.name == "torch_dist"
    load_model_weights(model, choice.directory, directory)
    tokens = torch.load(tokens_file)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        unwrap(model[0]).eval()
        local = unwrap(model[0])(tokens, positions, None).float()
        logits = gather_from_tensor_model_parallel_region(local)
    if torch.distributed.get_rank() == 0:
        torch.save(logits, out_file)


if __name__ == "__main__":
    main(sys.argv[1])
