"""Every family's Hugging Face interop across processes (torchrun, 2 processes), judged by
transformers with tests/test_hf_interop.py's bound: random models of transformers' own
classes (a Llama 3.1 with its RoPE scaling, a Llama with tied embeddings, a Mistral, a
Mixtral, a DeepSeek-V3) imported and read at TP 2, the MoE ones at EP 2 too (each rank holds
half the experts, tokens travel to them), give transformers' logits; a LLaMA trained at PP 2
and runs of both MoE families trained at EP 2, with the distributed optimizer, export
(gathered into one process) to models whose transformers logits equal ours. (A LLaMA trained
at TP 2: test_hf_interop_tp.py.)"""

import torch

from tests.distributed.test_hf_interop_tp import _logits_at_tp2
from tests.helpers import TINY, run_pretrain
from tests.test_hf_deepseek_v3 import DEEPSEEK_RUN, random_deepseek_v3
from tests.test_hf_interop import BOUND, cli, random_llama, relative_gap, tokens
from tests.test_hf_llama3 import _random_mistral, _rope
from tests.test_hf_mixtral import EXPERTS, TOPK, random_mixtral

TP2, EP2 = {"tp": 2}, {"ep": 2}
MODELS = {  # name: (how transformers' model is made, the layouts it is read at)
    "llama3.1": (lambda d: random_llama(d, rope_parameters=_rope(8.0)), [TP2]),
    "tied": (lambda d: random_llama(d, tie_word_embeddings=True), [TP2]),
    "mistral": (_random_mistral, [TP2]),
    "mixtral": (random_mixtral, [EP2, TP2]),
    "deepseek_v3": (random_deepseek_v3, [EP2, TP2]),
}


def test_every_family_read_and_trained_across_processes_gives_transformers_logits(tmp_path):
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    for name, (make, _) in MODELS.items():
        make(tmp_path / f"{name}_hf")
        assert cli("import-hf", str(tmp_path / f"{name}_hf"), str(tmp_path / name)) == 0
    torch.save(tokens(600), tmp_path / "tokens.pt")
    jobs = [[str(tmp_path / name), str(tmp_path / "tokens.pt"),
             str(tmp_path / f"{name}-{next(iter(layout))}.pt"), layout]
            for name, (_, layouts) in MODELS.items() for layout in layouts]
    _logits_at_tp2(jobs)
    for name, (_, layouts) in MODELS.items():
        theirs = judge.logits(judge.load(tmp_path / f"{name}_hf"), torch.load(tmp_path /
                                                                              "tokens.pt"))
        for layout in layouts:
            where = next(iter(layout))
            gap = relative_gap(torch.load(tmp_path / f"{name}-{where}.pt"), theirs)
            print(f"\n{name} imported, read at {where.upper()} 2: max |ours - transformers|"
                  f" / max |logit| = {gap:.2e}")
            assert gap <= BOUND, (name, layout, gap)

    at_ep2 = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    short = ["--train-iters", "3", "--eval-interval", "100"]
    trained = {  # name: (flags, the layout's words)
        "llama": ([*TINY, *short, "--pipeline-model-parallel-size", "2",
                   "--use-distributed-optimizer"], "PP 2"),
        "mixtral": ([*TINY, "--num-experts", str(EXPERTS), "--moe-aux-loss-coeff", "0.01",
                     "--moe-router-topk", str(TOPK),
                     *short, *at_ep2], "EP 2"),
        "deepseek_v3": ([*DEEPSEEK_RUN, *at_ep2], "EP 2"),
    }
    ids = tokens(4096)
    for name, (flags, where) in trained.items():
        run = tmp_path / f"{name}_run"
        run_pretrain([*flags, "--save", str(run)], nproc=2)
        assert cli("export-hf", str(run), str(tmp_path / f"{name}_export"), "--dtype",
                   "fp32") == 0
        model = judge.load(tmp_path / f"{name}_export")
        gap = relative_gap(logits_of(run, ids), judge.logits(model, ids))
        print(f"\n{name} trained at {where}, exported: max |ours - transformers| / max "
              f"|logit| = {gap:.2e}")
        assert gap <= BOUND, (name, gap)
