"""Mixtral in and out of the llama family (`model_families/llama_hf.py`), judged by
transformers' own MixtralForCausalLM on the CPU with the bound of tests/test_hf_interop.py
(max |ours - transformers| <= 1e-5 x max |transformers' logit|, float32): a random Mixtral
imported gives transformers' logits; export(import(x)) is x bit for bit, experts in
transformers' on-disk names; a MoE run of ours exported loads as MixtralForCausalLM with no
extra code and gives our logits; experts put in the wrong slots (the router then sends each
token to another expert's weights) break the bound; a routing Mixtral cannot express is
refused by name. Measured on this AMD EPYC: 1.3e-6 imported (logits up to 7.7)."""

import json
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


def test_an_imported_mixtral_gives_transformers_logits(imported):
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    ids = tokens(600)
    theirs = judge.logits(judge.load(imported / "hf"), ids)
    gap = relative_gap(logits_of(imported / "ours", ids), theirs)
    print(f"\nimported Mixtral: max |ours - transformers| / max |logit| = {gap:.2e}")
    assert gap <= BOUND
    assert float(theirs.abs().max()) > 1
    model_yaml = (imported / "ours" / "model.yaml").read_text()
    assert f"num_experts: {EXPERTS}" in model_yaml and f"moe_router_topk: {TOPK}" in model_yaml


def test_experts_in_the_wrong_slots_break_the_bound(imported, tmp_path):
    """The check can fail: layer 0's experts 0 and 1 swapped on disk (the router unchanged)."""
    from safetensors.torch import load_file, save_file

    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    bad = tmp_path / "hf"
    shutil.copytree(imported / "hf", bad)
    weights = load_file(str(bad / "model.safetensors"))
    prefix = "model.layers.0.block_sparse_moe.experts."
    for w in ("w1", "w2", "w3"):
        first, second = f"{prefix}0.{w}.weight", f"{prefix}1.{w}.weight"
        weights[first], weights[second] = weights[second], weights[first]
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert cli("import-hf", str(bad), str(tmp_path / "ours")) == 0
    ids = tokens(600)
    gap = relative_gap(logits_of(tmp_path / "ours", ids),
                       judge.logits(judge.load(imported / "hf"), ids))
    assert gap > 100 * BOUND, gap


def test_export_of_an_imported_mixtral_is_the_original_bit_for_bit(imported, tmp_path):
    from safetensors.torch import load_file

    assert cli("export-hf", str(imported / "ours"), str(tmp_path / "back"), "--dtype",
               "fp32") == 0
    original = load_file(str(imported / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    # per layer: q, k, v, o, two norms, the router, three weights per expert
    assert original.keys() == back.keys() and len(original) == 3 + 2 * (7 + 3 * EXPERTS)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    theirs = json.loads((imported / "hf" / "config.json").read_text())
    ours = json.loads((tmp_path / "back" / "config.json").read_text())
    assert ours["architectures"] == ["MixtralForCausalLM"]
    for key in ("intermediate_size", "num_local_experts", "num_experts_per_tok",
                "num_key_value_heads", "rms_norm_eps", "sliding_window"):
        assert ours[key] == theirs[key], key


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
