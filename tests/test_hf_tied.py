"""Tied embeddings across import-hf and export-hf, judged by transformers (the bound and
helpers of tests/test_hf_interop.py): a random Llama 3.2-shaped model of transformers' classes
(tie_word_embeddings, llama3 RoPE scaling with factor 32, 2 KV heads) imports as one matrix
(megatron-core's share_embeddings_and_output_weights) and gives transformers' logits; exported
it says tied and holds one matrix, the original bit for bit; fine-tuned, it stays one matrix
and its export gives our logits. A tied config whose weights disagree is refused, and so is
tying at PP > 1."""

import json

import pytest
import torch

from tests.hf_bpe_tokenizer import corpus_in
from tests.helpers import pretrain_in_process
from tests.test_hf_interop import HF_TOKENIZER, BOUND, cli, random_llama, relative_gap, tokens
from tests.test_hf_llama3 import _rope

pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    random_llama(root / "hf", tie_word_embeddings=True, rope_parameters=_rope(32.0))
    assert cli("import-hf", str(root / "hf"), str(root / "ours")) == 0
    return root


def _weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_a_tied_llama_imports_as_one_matrix_with_transformers_logits(tied):
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import load_weights_on_one_rank, logits_of

    assert "lm_head.weight" not in _weights(tied / "hf")  # transformers saves it tied
    assert "untie_embeddings_and_output_weights: false" in \
        (tied / "ours" / "model.yaml").read_text()
    _, state, _, _ = load_weights_on_one_rank(tied / "ours")
    assert "output_layer.weight" not in state and "embedding.word_embeddings.weight" in state
    ids = tokens(600)
    theirs = judge.logits(judge.load(tied / "hf"), ids)
    gap = relative_gap(logits_of(tied / "ours", ids), theirs)
    print(f"\ntied import: max |ours - transformers| / max |logit| = {gap:.2e}")
    assert gap <= BOUND and float(theirs.abs().max()) > 1


def test_a_tied_export_says_tied_and_holds_one_matrix(tied, tmp_path):
    from megatron_gnmr.interop.hf import judge

    assert cli("export-hf", str(tied / "ours"), str(tmp_path / "back"), "--dtype", "fp32") == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())[
        "tie_word_embeddings"] is True
    original, back = _weights(tied / "hf"), _weights(tmp_path / "back")
    assert back.keys() == original.keys()  # no lm_head.weight
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())
    model = judge.load(tmp_path / "back")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_finetuned_tied_model_stays_one_matrix(tied, tmp_path):
    """Both uses of the one matrix train it; its export is still tied and gives our logits."""
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import load_weights_on_one_rank, logits_of

    prefix = corpus_in(HF_TOKENIZER, tmp_path / "data", plays=1)
    run = tmp_path / "run"
    assert pretrain_in_process(["--config", str(tied / "ours" / "model.yaml"), "--data-path",
                                prefix, "--seq-length", "64", "--micro-batch-size", "4",
                                "--global-batch-size", "8", "--train-iters", "3",
                                "--eval-interval", "100", "--eval-iters", "1", "--lr", "1e-3",
                                "--finetune", "--load", str(tied / "ours"),
                                "--save", str(run)]) == 0
    _, state, _, _ = load_weights_on_one_rank(run)
    assert "output_layer.weight" not in state
    before = _weights(tied / "hf")["model.embed_tokens.weight"]
    assert not torch.equal(state["embedding.word_embeddings.weight"], before)  # it trained
    assert cli("export-hf", str(run), str(tmp_path / "hf"), "--dtype", "fp32") == 0
    assert "lm_head.weight" not in _weights(tmp_path / "hf")
    ids = tokens(600)
    gap = relative_gap(logits_of(run, ids), judge.logits(judge.load(tmp_path / "hf"), ids))
    print(f"\nfine-tuned tied export: max |ours - transformers| / max |logit| = {gap:.2e}")
    assert gap <= BOUND


def _save(directory, weights):
    from safetensors.torch import save_file

    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _set_tie(directory, value):
    config = json.loads((directory / "config.json").read_text())
    config["tie_word_embeddings"] = value
    (directory / "config.json").write_text(json.dumps(config))


def _other_head(directory):
    weights = _weights(directory)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].flip(0).contiguous()
    _save(directory, weights)


@pytest.mark.parametrize("damage,named", [
    (_other_head, "tie_word_embeddings true, but the weights hold an lm_head.weight"),
    (lambda d: _set_tie(d, False), "tie_word_embeddings False, but the weights hold no "
     "lm_head.weight"),
], ids=["tied_but_another_head", "untied_without_head"])
def test_tying_that_disagrees_with_the_weights_is_refused(tied, tmp_path, capfd, damage, named):
    import shutil

    shutil.copytree(tied / "hf", tmp_path / "hf")
    damage(tmp_path / "hf")
    capfd.readouterr()
    assert cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")) == 2
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_tying_at_two_pipeline_stages_is_refused(tmp_path, capfd):
    from tests.helpers import TINY

    capfd.readouterr()
    assert pretrain_in_process([*TINY, "--no-untie-embeddings-and-output-weights",
                                "--pipeline-model-parallel-size", "2", "--num-layers", "2",
                                "--train-iters", "1", "--save", str(tmp_path / "run")]) == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "tied embeddings are built at one pipeline stage" in errors[0]
