"""Data as Megatron-LM users have it: a two-dataset blend tokenized by prepare-data with a
Hugging Face tokenizer (made with the `tokenizers` library), trained on, and the mixture the
run actually read measured against the weights; the other blend forms read as megatron-core
reads them; mock data with NullTokenizer and the vocabulary padded as Megatron-LM pads it."""

import json
import sys

import numpy as np
import pytest

from tests.helpers import REPO, TINY, read_jsonl, saved_weight_shapes

HF = REPO / "tests" / "fixtures" / "megatron_preprocess" / "tokenizers" / "huggingface"
CORPUS = REPO / ".cache" / "megatron_gnmr" / "corpora" / "shakespeare"
STEPS, BATCH = 12, 16
WEIGHTS = (0.3, 0.7)


def _jsonl(path, lines: list[str], shout: bool) -> None:
    """Documents of 40 lines; `shout`: in capitals, so a sample's origin shows in its text."""
    with path.open("w") as out:
        for start in range(0, len(lines) - 40, 40):
            text = "\n".join(lines[start:start + 40])
            out.write(json.dumps({"text": text.upper() if shout else text.lower()}) + "\n")


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    from megatron_gnmr.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("blend")
    lines = [line for line in (CORPUS / "hamlet_gut.txt").read_text().splitlines()
             if line.strip()]
    _jsonl(root / "a.jsonl", lines[: len(lines) // 2], shout=True)
    _jsonl(root / "b.jsonl", lines[len(lines) // 2:], shout=False)
    tokenizer = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(HF)}
    for name in ("a", "b"):
        preprocess([str(root / f"{name}.jsonl")], str(root / name), tokenizer, ["text"],
                   append_eod=True, workers=2, quiet=True)
    return root


def _train(args: list[str], read: dict | None = None):
    """The entry point in this process; `read`: every sample each reader reads (by reader:
    "training", "validation": read while the trainer evaluates; no reading threads, so
    without --num-workers a read happens where its step or evaluation asks for it), filled
    in."""
    sys.path.insert(0, str(REPO))
    try:
        from pretrain_llama import main
    finally:
        sys.path.remove(str(REPO))
    from megatron_gnmr.data.datasets import BatchReader
    from megatron_gnmr.training.loop import Trainer

    original, evaluate = BatchReader._micro_batch, Trainer.evaluate
    evaluating = []

    def recording(self, step, micro):
        batch = original(self, step, micro)
        if read is not None:
            reader = "validation" if evaluating else "training"
            read.setdefault(reader, []).extend(batch["tokens"].tolist())
        return batch

    def flagged(self):
        evaluating.append(self)
        try:
            return evaluate(self)
        finally:
            evaluating.pop()

    BatchReader._micro_batch, Trainer.evaluate = recording, flagged
    try:
        return main(args)
    finally:
        BatchReader._micro_batch, Trainer.evaluate = original, evaluate


def test_a_weighted_blend_with_a_hugging_face_tokenizer_draws_its_weights(blend, tmp_path):
    from megatron_gnmr.data.tokenizers import HuggingFace

    readers: dict[int, list] = {}
    run = tmp_path / "run"
    _train([*TINY, "--global-batch-size", str(BATCH), "--micro-batch-size", "8",
            "--train-iters", str(STEPS), "--eval-interval", "100", "--split", "90,10,0",
            "--data-path", str(WEIGHTS[0]), str(blend / "a_text_document"), str(WEIGHTS[1]),
            str(blend / "b_text_document"), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(HF), "--save", str(run)], readers)
    read = next(samples for samples in readers.values() if len(samples) == STEPS * BATCH)
    tokenizer = HuggingFace(HF)
    letters = [(sum(c.isupper() for c in text), sum(c.islower() for c in text))
               for text in (tokenizer.decode(tokens) for tokens in read)]
    from_a = sum(upper > lower for upper, lower in letters)
    assert all(upper == 0 or lower == 0 for upper, lower in letters)  # one source per sample
    measured = from_a / len(read)
    # megatron-core's blend chooses each next sample from the dataset furthest below its
    # weight, so after N samples each share is within 1/N of its weight
    assert abs(measured - WEIGHTS[0]) <= 1.0 / len(read) + 1e-9, measured
    mixture = next(r for r in read_jsonl(run / "metrics.jsonl")
                   if r.get("event") == "data_mixture")["datasets"]
    assert [round(row["weight"], 6) for row in mixture] == list(WEIGHTS)
    assert mixture[0]["share drawn"] == pytest.approx(measured)
    losses = [r["train/loss"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_the_blend_forms_read_as_megatron_core_reads_them(blend, tmp_path):
    """Weight-prefix pairs, prefixes alone (weights from sizes: None), --data-args-path, and
    the per-split JSON with a space-separated string."""
    from types import SimpleNamespace

    from megatron_gnmr.data.config import DataConfig
    from megatron_gnmr.data.sources import plan_from

    a, b = str(blend / "a_text_document"), str(blend / "b_text_document")
    assert plan_from(DataConfig(data_path=["1", a, "3", b])).blend == ([a, b], [1.0, 3.0])
    assert plan_from(DataConfig(data_path=[a, b])).blend == ([a, b], None)
    assert plan_from(DataConfig(data_path=[a])).blend == ([a], None)
    (tmp_path / "args.txt").write_text(f"2 {a}\n 5 {b}\n")
    assert plan_from(DataConfig(data_args_path=str(tmp_path / "args.txt"))).blend == \
        ([a, b], [2.0, 5.0])
    (tmp_path / "splits.json").write_text(json.dumps({"train": f"1 {a} 1 {b}", "valid": [b],
                                                      "test": None}))
    plan = plan_from(DataConfig(per_split_data_args_path=str(tmp_path / "splits.json")))
    assert plan.blend is None and plan.blend_per_split == [([a, b], [1.0, 1.0]), ([b], None),
                                                           None]
    del SimpleNamespace


def _indexed_text(prefix) -> tuple[str, int]:
    """A prepared file's documents as megatron-core's IndexedDataset reads them, one character
    per token id (so a run of tokens is found by substring search), and the end-of-document
    id every document ends with."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = [doc.tolist() for doc in IndexedDataset(str(prefix))]
    eod = documents[0][-1]
    assert all(doc[-1] == eod for doc in documents)
    return "".join(chr(token) for doc in documents for token in doc), eod


def _runs(sample: list[int], eod: int) -> list[str]:
    """A sample's stretches between end-of-document tokens: each lies inside one document."""
    return [run for run in "".join(map(chr, sample)).split(chr(eod)) if run]


def _origin_mismatches(samples: list[list[int]], own: str, other: str, eod: int) -> list[int]:
    """The samples that are not made of `own`'s documents alone, or that `other` could have
    given as well (then the check would tell nothing)."""
    return [i for i, sample in enumerate(samples)
            if not all(run in own for run in _runs(sample, eod))
            or all(run in other for run in _runs(sample, eod))]


def test_per_split_paths_train_and_validate_on_their_own_data(blend, tmp_path):
    """What the training reader and the validation reader read, found in the prepared files:
    every stretch of every training sample is a stretch of a document of --train-data-path
    (and not all of it is in --valid-data-path's), and the other way round for validation;
    decoded, training reads the capitals of a and validation the small letters of b."""
    from tokenizers import Tokenizer

    readers: dict[int, list] = {}
    run = tmp_path / "run"
    _train([*TINY, "--train-iters", "3", "--eval-interval", "3", "--train-data-path",
            str(blend / "a_text_document"), "--valid-data-path", str(blend / "b_text_document"),
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(HF),
            "--save", str(run)], readers)
    assert any("valid/loss" in r for r in read_jsonl(run / "metrics.jsonl"))
    train, valid = readers["training"], readers["validation"]
    assert len(train) == 3 * 8 and len(valid) >= 2 * 8  # --train-iters, --eval-iters
    a, eod = _indexed_text(blend / "a_text_document")
    b, b_eod = _indexed_text(blend / "b_text_document")
    assert eod == b_eod
    assert _origin_mismatches(train, own=a, other=b, eod=eod) == []
    assert _origin_mismatches(valid, own=b, other=a, eod=eod) == []
    decode = Tokenizer.from_file(str(HF / "tokenizer.json")).decode
    for samples, capitals in ((train, True), (valid, False)):
        for text in map(decode, samples):
            upper, lower = sum(c.isupper() for c in text), sum(c.islower() for c in text)
            assert (upper > 0 and lower == 0) if capitals else (lower > 0 and upper == 0), text


def test_mock_data_with_a_null_tokenizer_pads_the_vocabulary_as_megatron_lm(tmp_path):
    """NullTokenizer --vocab-size 1000: 1001 ids (the eod is id 1000), padded to a multiple of
    128 x TP = 1024 embedding rows, as Megatron-LM's _vocab_size_with_padding gives."""
    run = tmp_path / "run"
    _train([*TINY, "--train-iters", "3", "--eval-interval", "100", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--save", str(run)])
    shapes = saved_weight_shapes(run)
    assert next(v for k, v in shapes.items() if k.endswith("word_embeddings.weight"))[0] == 1024
