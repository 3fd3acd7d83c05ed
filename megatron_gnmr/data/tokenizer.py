"""A SentencePiece BPE tokenizer trained locally, with exact round trips.

SentencePiece's defaults normalise text (NFKC, collapsed spaces, dropped newlines), which
ruins verse and code; `identity` normalisation, kept whitespace, a `\n` symbol and byte
fallback make `decode(encode(text)) == text` for any UTF-8 input.

`Tokenizer` exposes what megatron-core's GPTDataset reads from a tokenizer (`vocab_size`,
`eod`, `pad`, `unique_identifiers`) without depending on megatron's tokenizer registry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import sentencepiece

from megatron_gnmr.errors import UserError

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


class Tokenizer:
    """A trained SentencePiece model, in the shape megatron-core's datasets expect."""

    def __init__(self, model_path: str | Path, flag: str = "tokenizer model"):
        path = Path(model_path)
        if not path.is_file():
            raise UserError(f"{flag} {path}: no such file (run `megatron-gnmr prepare-data`, "
                            "or pass --tokenizer-model)")
        self.model_path = path
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as error:
            raise UserError(f"{flag} {path}: not a SentencePiece model "
                            f"({str(error).splitlines()[0][:120]})") from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self.eos = EOS_ID
        self.pad = PAD_ID
        self.unique_identifiers = {"class": "SentencePieceBPE", "model": path.name,
                                   "vocab_size": self.vocab_size}

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)
