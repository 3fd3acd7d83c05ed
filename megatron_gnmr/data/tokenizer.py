"""A SentencePiece BPE tokenizer trained locally, with exact round trips.

SentencePiece's defaults normalise text (NFKC, collapsed spaces, dropped newlines), which
ruins verse and code; `identity` normalisation, kept whitespace, a `\n` symbol and byte
fallback make `decode(encode(text)) == text` for any UTF-8 input.

The trained model is read as Megatron-LM's GPTSentencePieceTokenizer reads one
(`data/tokenizers.py`: eod = its eos, pad = its pad).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import sentencepiece


# Special ids: unk 0, bos 1, eos (= end of document) 2, pad 3.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


def train_tokenizer(documents: Iterable[str], model_path: Path, vocab_size: int) -> None:
    """Train a BPE model on `documents` and write it to `model_path` (a .model file)."""
    model_path.parent.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_lines(documents),
        model_prefix=str(model_path.with_suffix("")),
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_by_whitespace=True,
        user_defined_symbols=["\n"],
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        num_threads=2,
        minloglevel=2,
    )


def _lines(documents: Iterable[str]):
    # The trainer reads "sentences"; keep the newline so it learns the "\n" symbol in context.
    for document in documents:
        for line in document.splitlines(keepends=True):
            if line.strip():
                yield line[:4096]
