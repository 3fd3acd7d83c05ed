"""prepare-data writes what Megatron-LM's `tools/preprocess_data.py` writes, byte for byte, on
the committed input and tokenizers (tests/fixtures/megatron_preprocess/README.md says how the
reference files were made with that tool), with one and with two workers."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import REPO

FIXTURE = REPO / "tests" / "fixtures" / "megatron_preprocess"
TOKENIZERS = {
    "huggingface": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                    str(FIXTURE / "tokenizers" / "huggingface")],
    "sentencepiece": ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                      str(FIXTURE / "tokenizers" / "sentencepiece.model")],
    "gpt2": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
             str(FIXTURE / "tokenizers" / "gpt2" / "vocab.json"), "--merge-file",
             str(FIXTURE / "tokenizers" / "gpt2" / "merges.txt")],
}


def _prepare(tmp_path, name: str, workers: int, command_line: bool = False) -> Path:
    """prepare-data as a user runs it (`command_line`), else its function in this process."""
    prefix = tmp_path / f"w{workers}" / name
    flags = TOKENIZERS[name]
    if command_line:
        subprocess.run([sys.executable, "-m", "megatron_gnmr.cli", "prepare-data", "--input",
                        str(FIXTURE / "input.jsonl"), "--output-prefix", str(prefix), *flags,
                        "--append-eod", "--workers", str(workers)],
                       check=True, capture_output=True, text=True, cwd=REPO)
        return prefix
    from megatron_gnmr.data.preprocess import preprocess

    tokenizer = {flags[i][2:].replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
    preprocess([str(FIXTURE / "input.jsonl")], str(prefix), tokenizer, ["text"], True, workers,
               quiet=True)
    return prefix


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_prepare_data_writes_megatron_lm_bytes(tmp_path, name):
    for workers in (1, 2):
        prefix = _prepare(tmp_path, name, workers, command_line=(name, workers) == ("gpt2", 2))
        for suffix in (".bin", ".idx"):
            ours = Path(f"{prefix}_text_document{suffix}").read_bytes()
            theirs = (FIXTURE / "megatron_lm_output" / f"{name}_text_document{suffix}")
            assert ours == theirs.read_bytes(), (name, workers, suffix)


def test_the_reference_holds_what_it_should():
    """The fixture is not vacuous: 22 documents, the empty one an entry of no sequence, the
    others ending in the tokenizer's eos, and the Hugging Face template's bos left out."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    config = json.loads((FIXTURE / "tokenizers" / "huggingface" /
                         "tokenizer_config.json").read_text())
    vocab = json.loads((FIXTURE / "tokenizers" / "huggingface" /
                        "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in vocab}
    data = IndexedDataset(str(FIXTURE / "megatron_lm_output" / "huggingface_text_document"))
    assert len(data.document_indices) - 1 == 22 and len(data) == 21
    assert np.diff(data.document_indices).tolist().count(0) == 1  # the empty text
    for sequence in range(len(data)):
        tokens = data[sequence]
        assert tokens[-1] == ids[config["eos_token"]]
        assert tokens[0] != ids[config["bos_token"]]


def test_workers_die_on_terminate_whatever_the_parent_does_with_sigterm():
    """A process that trained before (its preemption handler only notes SIGTERM) forks
    tokenizing workers that still die on SIGTERM: the pool's terminate() at the end of
    prepare-data waited forever on workers that inherited the noting handler (a hung CI)."""
    import signal

    from megatron_gnmr.data.preprocess import _worker_pool

    flags = TOKENIZERS["sentencepiece"]
    tokenizer = {flags[i][2:].replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
    noted = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: noted.append(number))
    try:
        pool = _worker_pool(2, tokenizer)
        with pool:
            assert pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the parent's kept
    finally:
        signal.signal(signal.SIGTERM, previous)
