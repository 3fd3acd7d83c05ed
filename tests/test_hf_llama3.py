"""The configs people hold today, through import-hf and export-hf, judged by transformers'
logits on random small models of its own classes (the bound and helpers of
tests/test_hf_interop.py): Llama 3.1 and 3.2's RoPE scaling (rope_type llama3, factor 8 and
32, through megatron-core's own scaling), exported back with it; a scaling dropped on the way
in breaks the bound; a rope type megatron-core does not build, or other bands than Llama 3's,
is refused by name; Mistral's class with a sliding window is refused (without one: tests/test_hf_families.py)."""

import json

import pytest

from tests.test_hf_interop import BOUND, cli, random_llama, relative_gap, tokens

pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")

# rope_theta 10000 with 16-wide heads puts RoPE frequencies in all three of Llama 3's bands
# (kept, smoothed, slowed by the factor) within 48 positions: the scaling shows in the logits
LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _rope(factor: float) -> dict:
    return {"rope_theta": 10000.0, **LLAMA3, "factor": factor}


@pytest.mark.parametrize("factor", [8.0, 32.0], ids=["llama3.1", "llama3.2"])
def test_llama3_rope_scaling_gives_transformers_logits_both_ways(factor, tmp_path):
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    hf = random_llama(tmp_path / "hf", rope_parameters=_rope(factor))
    assert cli("import-hf", str(hf), str(tmp_path / "ours")) == 0
    model_yaml = (tmp_path / "ours" / "model.yaml").read_text()
    assert "use_rope_scaling: true" in model_yaml and f"rope_scaling_factor: {factor}" in \
        model_yaml
    ids = tokens(600)
    theirs = judge.logits(judge.load(hf), ids)
    assert relative_gap(logits_of(tmp_path / "ours", ids), theirs) <= BOUND
    plain = judge.logits(judge.load(random_llama(tmp_path / "plain",
                                                 rope_parameters={"rope_theta": 10000.0})),
                         ids)
    assert relative_gap(plain, theirs) > 100 * BOUND  # the scaling matters at these lengths
    assert cli("export-hf", str(tmp_path / "ours"), str(tmp_path / "back"), "--dtype",
               "fp32") == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]
    assert back["rope_type"] == "llama3" and back["factor"] == factor
    assert relative_gap(judge.logits(judge.load(tmp_path / "back"), ids), theirs) <= BOUND


def test_a_dropped_scaling_breaks_the_bound(tmp_path):
    """The check can fail: the same checkpoint imported as plain RoPE (the scaling dropped)."""
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    hf = random_llama(tmp_path / "hf", rope_parameters=_rope(8.0))
    assert cli("import-hf", str(hf), str(tmp_path / "ours")) == 0
    config = tmp_path / "ours" / "config.json"
    values = json.loads(config.read_text())
    assert values["model"]["use_rope_scaling"] is True
    values["model"]["use_rope_scaling"] = False
    config.write_text(json.dumps(values))
    ids = tokens(600)
    gap = relative_gap(logits_of(tmp_path / "ours", ids), judge.logits(judge.load(hf), ids))
    assert gap > 100 * BOUND, gap


@pytest.mark.parametrize("rope,named", [
    ({"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}, "rope type 'yarn'"),
    ({**_rope(8.0), "high_freq_factor": 2.0}, "rope high_freq_factor 2.0"),
], ids=["yarn", "other_bands"])
def test_a_rope_megatron_core_does_not_build_is_refused(rope, named, tmp_path, capfd):
    hf = random_llama(tmp_path / "hf", rope_parameters=rope)
    capfd.readouterr()
    assert cli("import-hf", str(hf), str(tmp_path / "ours")) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert len(error) == 1 and named in error[0], error
    assert not (tmp_path / "ours").exists()


def _random_mistral(directory, **overrides):
    """A random Mistral of transformers' own classes (no sliding window unless given)."""
    import shutil

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from tests.test_hf_interop import HF_TOKENIZER

    torch.manual_seed(3)
    settings = dict(vocab_size=640, hidden_size=64, intermediate_size=176,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
                    initializer_range=0.2, tie_word_embeddings=False, sliding_window=None,
                    rope_theta=1000000.0)
    model = MistralForCausalLM(MistralConfig(**{**settings, **overrides})).float()
    model.save_pretrained(str(directory), safe_serialization=True)
    for file in HF_TOKENIZER.iterdir():
        shutil.copyfile(file, directory / file.name)
    return directory


def test_a_sliding_window_is_refused_by_name(tmp_path, capfd):
    hf = _random_mistral(tmp_path / "hf", sliding_window=32)
    capfd.readouterr()
    assert cli("import-hf", str(hf), str(tmp_path / "ours")) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "sliding_window 32" in error[0], error
    assert not (tmp_path / "ours").exists()
