"""Every family's Hugging Face interop across processes (torchrun, 2 processes), judged by
transformers with tests/test_hf_interop.py's bound: random models of transformers' own
classes (a Llama 3.1 with its RoPE scaling, a Llama with tied embeddings, a Mistral, a
Mixtral, a DeepSeek-V3) imported and read at TP 2, the MoE ones at EP 2 too (each rank holds
half the experts, tokens travel to them), give transformers' logits; a LLaMA trained at PP 2
and runs of both MoE families trained at EP 2, with the distributed optimizer, export
(gathered into one process) to models whose transformers logits equal ours. (A LLaMA trained
at TP 2: test_hf_interop_tp.py.)"""

import pytest
import torch

from tests.distributed.test_hf_interop_tp import _logits_at_tp2
from tests.helpers import TINY, run_pretrain
from tests.test_hf_deepseek_v3 import DEEPSEEK_RUN, random_deepseek_v3
from tests.test_hf_interop import BOUND, cli, random_llama, relative_gap, tokens
from tests.test_hf_llama3 import _random_mistral, _rope
from tests.test_hf_mixtral import EXPERTS, TOPK, random_mixtral

MODELS = {  # name: (how transformers' model is made, the parallel axes it is read along at 2)
    "llama3.1": (lambda d: random_llama(d, rope_parameters=_rope(8.0)), ["tp"]),
    "tied": (lambda d: random_llama(d, tie_word_embeddings=True), ["tp"]),
    "mistral": (_random_mistral, ["tp"]),
    "mixtral": (random_mixtral, ["ep", "tp"]),
    "deepseek_v3": (random_deepseek_v3, ["ep", "tp"]),
}
READ = [(name, layout) for name, (_, layouts) in MODELS.items() for layout in layouts]
AT_EP2 = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
SHORT = ["--train-iters", "3", "--eval-interval", "100"]
TRAINED = {  # name: (flags, the layout's words)
    "llama": ([*TINY, *SHORT, "--pipeline-model-parallel-size", "2",
               "--use-distributed-optimizer"], "PP 2"),
    "mixtral": ([*TINY, "--num-experts", str(EXPERTS), "--moe-aux-loss-coeff", "0.01",
                 "--moe-router-topk", str(TOPK), *SHORT, *AT_EP2], "EP 2"),
    "deepseek_v3": ([*DEEPSEEK_RUN, *AT_EP2], "EP 2"),
}


@pytest.fixture(scope="module")
def read(tmp_path_factory):
    """Every family imported, then read at each of its layouts in one torchrun launch; the
    import's exit code per family, so one family's failure is its own tests' failure."""
    where = tmp_path_factory.mktemp("hf_families")
    imported = {}
    for name, (make, _) in MODELS.items():
        make(where / f"{name}_hf")
        imported[name] = cli("import-hf", str(where / f"{name}_hf"), str(where / name))
    torch.save(tokens(600), where / "tokens.pt")
    _logits_at_tp2([[str(where / name), str(where / "tokens.pt"),
                     str(where / f"{name}-{layout}.pt"), {layout: 2}]
                    for name, layout in READ if imported[name] == 0], leave_errors=True)
    return where, imported


@pytest.mark.parametrize("name, layout", READ, ids=[f"{n}-{w}2" for n, w in READ])
def test_a_family_imported_and_read_across_processes_gives_transformers_logits(read, name,
                                                                               layout):
    from megatron_gnmr.interop.hf import judge

    where, imported = read
    assert imported[name] == 0, f"import-hf {name} exited {imported[name]}"
    error = where / f"{name}-{layout}.pt.error"
    assert not error.exists(), error.read_text()[-3000:]
    theirs = judge.logits(judge.load(where / f"{name}_hf"), torch.load(where / "tokens.pt"))
    gap = relative_gap(torch.load(where / f"{name}-{layout}.pt"), theirs)
    print(f"\n{name} imported, read at {layout.upper()} 2: max |ours - transformers| / max "
          f"|logit| = {gap:.2e}")
    assert gap <= BOUND, (name, layout, gap)


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_a_family_trained_across_processes_exports_to_transformers_logits(tmp_path, name):
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    flags, layout = TRAINED[name]
    run = tmp_path / f"{name}_run"
    run_pretrain([*flags, "--save", str(run)], nproc=2)
    assert cli("export-hf", str(run), str(tmp_path / "export"), "--dtype", "fp32") == 0
    ids = tokens(4096)
    gap = relative_gap(logits_of(run, ids), judge.logits(judge.load(tmp_path / "export"), ids))
    print(f"\n{name} trained at {layout}, exported: max |ours - transformers| / max |logit| = "
          f"{gap:.2e}")
    assert gap <= BOUND, (name, gap)
