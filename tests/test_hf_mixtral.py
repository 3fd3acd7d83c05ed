"""Mixtral in and out of the llama family (`model_families/llama_hf.py`), judged by
transformers' own MixtralForCausalLM on the CPU with the bound of tests/test_hf_interop.py
(max |ours - transformers| <= 1e-5 x max |transformers' logit|, float32): a MoE run of ours
exported loads as MixtralForCausalLM with no extra code and gives our logits; a routing
Mixtral cannot express is refused by name. A random Mixtral imported (transformers' logits,
experts in the wrong slots breaking the bound, export(import(x)) = x bit for bit):
tests/test_hf_families.py, with every other class import-hf reads. Measured on this AMD EPYC: 1.3e-6 imported (logits up to 7.7)."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY, pretrain_in_process
from tests.test_hf_interop import BOUND, HF_TOKENIZER, cli, relative_gap, tokens

pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")

EXPERTS, TOPK = 4, 2


def random_mixtral(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random Mixtral of transformers' own classes (GQA, random norms, untied head, 4
    experts, top-2), saved as safetensors with the fixture's tokenizer (600 tokens)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=640, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
                    tie_word_embeddings=False, num_local_experts=EXPERTS,
                    num_experts_per_tok=TOPK, sliding_window=None)
    model = MixtralForCausalLM(MixtralConfig(**{**settings, **overrides})).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(str(directory), safe_serialization=True)
    for file in HF_TOKENIZER.iterdir():
        shutil.copyfile(file, directory / file.name)
    return directory


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    hf = random_mixtral(root / "hf")
    assert cli("import-hf", str(hf), str(root / "ours")) == 0
    return root


def test_an_imported_mixtral_reads_its_experts(imported):
    """The logits, the defects that break them and the round trip: tests/test_hf_families.py."""
    model_yaml = (imported / "ours" / "model.yaml").read_text()
    assert f"num_experts: {EXPERTS}" in model_yaml and f"moe_router_topk: {TOPK}" in model_yaml


def test_a_moe_run_exported_loads_as_mixtral_with_our_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    run = tmp_path / "run"
    assert pretrain_in_process([*TINY, "--num-experts", str(EXPERTS), "--moe-aux-loss-coeff",
                                "0.01", "--moe-router-topk", str(TOPK), "--train-iters", "3",
                                "--eval-interval", "100",
                                "--save", str(run)]) == 0
    assert cli("export-hf", str(run), str(tmp_path / "hf"), "--dtype", "fp32") == 0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))  # no extra code
    assert type(model).__name__ == "MixtralForCausalLM"
    ids = tokens(4096)
    theirs = judge.logits(model.float(), ids)
    gap = relative_gap(logits_of(run, ids), theirs)
    print(f"\nexported MoE run: max |ours - transformers| / max |logit| = {gap:.2e}")
    assert gap <= BOUND


@pytest.mark.parametrize("flags,named", [
    (["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"],
     "--moe-router-score-function sigmoid"),
    (["--moe-shared-expert-intermediate-size", "32"], "--moe-shared-expert-intermediate-size"),
    (["--moe-first-dense-layers", "1"], "--moe-first-dense-layers 1"),
], ids=["sigmoid_router", "shared_expert", "dense_first_layer"])
def test_a_routing_mixtral_cannot_express_is_refused_by_name(flags, named):
    """What Mixtral's class has no field for is refused before anything is written (checked
    on the run's config, as export-hf checks it first)."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.errors import UserError
    from megatron_gnmr.model_families import hf_mapping

    config = parse_config([*TINY, "--num-experts", str(EXPERTS), *flags])
    with pytest.raises(UserError, match=named.replace("-", r"\-")) as error:
        hf_mapping(config, "export-hf RUN")
    assert "MixtralForCausalLM" in str(error.value)
